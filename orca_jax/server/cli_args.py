"""`python -m orca_jax.serve`'s flags, a --config YAML file under them, and what they build.

Flag names follow vLLM's where vLLM has the flag. No jax here: `--help` and flag errors come back
at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jinja2

from orca_jax.config import (KVCacheDtype, Quantization, DTYPES, AttentionBackend, CacheConfig, EngineConfig, KVAllocation, LoRAConfig,
                             ParallelConfig, SamplingConfig, SchedulerConfig, SchedulingPolicy)
from orca_jax.engine.defaults import SERVER_SCHEDULING, BatchDefaults, UsageContext, batch_defaults_for
from orca_jax.json_limits import DEFAULT_MAX_DEPTH, MAX_DEPTH_LIMIT
from orca_jax.models import presets
from orca_jax.server.app import DEFAULT_MAX_BODY_BYTES, LOCAL_HOSTS
from orca_jax.server.fine_tuning import add_fine_tuning_arguments, fine_tuning_config_from_args
from orca_jax.server.http_limits import HTTPLimits
from orca_jax.server.lora import add_lora_arguments, lora_config_from_args, parse_lora_modules
from orca_jax.server.preprocess import add_grammar_arguments, frontend_limits_from_args, grammar_limits_from_args
from orca_jax.server.serving import DEFAULT_MAX_TOKENS
from orca_jax.server.structured import ToolCallSettings
from orca_jax.structured.tool_parsers import TOOL_PARSERS

PROG = "python -m orca_jax.serve"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Not given, --long-prefill-token-threshold is this share of the token budget (engine/defaults.py).
LONG_PREFILL_SHARE = SERVER_SCHEDULING.long_prefill_share
# The server's default, unlike the library's (RESERVE, ORCA as published): chats without max_tokens
# then share the pool instead of running one at a time (measured: notes/policy.md, docs/scheduling.md).
SERVE_KV_ALLOCATION = SERVER_SCHEDULING.kv_allocation


def _default(config_class: type, field_name: str):
    """A config field's default, so flags and library share one source of truth."""
    return next(f.default for f in dataclasses.fields(config_class) if f.name == field_name)


def string_list(value: str) -> tuple[str, ...]:
    """A flag's list of strings: JSON ('["a", "b"]', as vLLM takes it) or comma-separated ("a,b")."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return tuple(items)
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _json_depth(value: str) -> int:
    """--max-json-depth: 1 to MAX_DEPTH_LIMIT (deeper would reach Python's stack limit in a parser)."""
    try:
        depth = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if not 1 <= depth <= MAX_DEPTH_LIMIT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_DEPTH_LIMIT}, got {depth}")
    return depth


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has one to show; a None default's meaning is in the help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action, argparse.BooleanOptionalAction) and "%(default)" not in action.help \
                and action.default is not None:
            return action.help + " (default: %(default)s)"
        if action.default is None or action.nargs == 0:  # a plain switch is off unless given
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, formatter_class=_HelpFormatter,
                                description="flags -> EngineConfig -> Engine -> create_app -> uvicorn; an "
                                "OpenAI-compatible server. It logs one 'ready at http://HOST:PORT' line once "
                                "every program is compiled (/health answers 200 from then on).")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a YAML file of flags (max-num-seqs: 8, allowed-origins: [...]); flags given on the "
                   "command line override it")

    model = p.add_argument_group("model")
    model.add_argument("--model", default="smollm2-135m",
                       help=f"a preset ({presets.describe_presets()}; the rest random weights) or a path to "
                       f"{presets.MODEL_FORMATS}; a Hugging Face Hub id must be downloaded first")
    model.add_argument("--served-model-name", default=None, help="the name clients use; --model's when not given")
    model.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                       help="weights, activations and KV; auto: the checkpoint's (a preset's own)")
    model.add_argument("--quantization", "-q", choices=[q.value for q in Quantization], default=None,
                       help="fp8: e4m3 projection weights with per-channel scales (half the bytes of bf16); "
                       "a 16/32-bit checkpoint is quantized at load, an FP8 checkpoint is read as FP8 "
                       "without the flag")
    model.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction,
                       default=_default(EngineConfig, "quantize_lm_head"),
                       help="with --quantization, store an untied LM head quantized too (a decode step reads "
                       "fewer bytes); --no-quantize-lm-head keeps it in --dtype, as vLLM does, for accuracy")
    model.add_argument("--kv-cache-dtype", choices=[d.value for d in KVCacheDtype], default="auto",
                       help="fp8: e4m3 KV pages, twice the tokens in the same memory; auto: the model's dtype")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="cap on prompt + completion tokens; the model's own context when not given")
    model.add_argument("--chat-template", default=None,
                       help="a jinja chat template, as a file or inline; the model's own when not given")
    model.add_argument("--seed", type=int, default=0, help="seed of random weights and unseeded sampling")
    model.add_argument("--max-logprobs", type=int, default=_default(SamplingConfig, "max_logprobs"),
                       help="the most logprobs (top_logprobs) a request may ask for; sizes the sampling programs")
    model.add_argument("--max-stop-strings", type=int, default=_default(SamplingConfig, "max_stop_strings"),
                       help="the most stop strings one request may give (more: 400)")
    model.add_argument("--max-stop-chars", type=int, default=_default(SamplingConfig, "max_stop_chars"),
                       help="the most characters one request's stop strings may hold together (more: 400); "
                       "each request's are built into one automaton when it is added, ~1-2 us a character")
    model.add_argument("--enable-prompt-logprobs", action="store_true",
                       help="let requests ask for prompt_logprobs (and completions for echo with logprobs): one "
                       "more forward over the prompt of each request that asks, and one more program per "
                       "prompt length bucket to compile at start")

    sched = p.add_argument_group("scheduling")
    sched.add_argument("--max-num-seqs", type=int, default=None,
                       help="requests per iteration (ORCA's max batch size); the device's default when not "
                       "given (256 on a GPU with >= 40 GiB, 128 on a smaller one, 64 on CPU)")
    sched.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per iteration; longer prompts are fed over several; the device's default "
                       "when not given (4096 on a GPU with >= 40 GiB, 2048 on a smaller one, 512 on CPU)")
    sched.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="the most prompt tokens one request feeds per iteration it shares with other "
                       "requests (the rest wait for the next), so a long prompt cannot hold up decodes and "
                       "new prompts; a prompt alone in its batch takes the whole budget. Not given: "
                       f"--max-num-batched-tokens / {LONG_PREFILL_SHARE}; 0: no cap")
    sched.add_argument("--max-waiting", type=int, default=_default(SchedulerConfig, "max_waiting"),
                       help="requests queued beyond the running batch; more get 503 + Retry-After")
    sched.add_argument("--scheduling-policy", choices=[s.value for s in SchedulingPolicy] + ["deadline"],
                       default=SERVER_SCHEDULING.policy.value,
                       help="priority lets interactive chat (high 'priority') overtake batch jobs; das is "
                       "TCB's deadline-aware scheduler (requests' deadline_ms); sjf and edf for comparison")
    sched.add_argument("--kv-allocation", choices=[k.value for k in KVAllocation],
                       default=SERVE_KV_ALLOCATION.value,
                       help="on_demand: KV pages as requests grow, preempting (and later recomputing) the "
                       "lowest-ranked request when the pool runs dry; reserve: ORCA's up-front reservation "
                       "of prompt + max_tokens, which never preempts but runs requests with a large "
                       "max_tokens few at a time")
    sched.add_argument("--priority-preemption", action=argparse.BooleanOptionalAction,
                       default=SERVER_SCHEDULING.priority_preemption,
                       help="under --scheduling-policy priority, a request that does not fit preempts running "
                       "requests it outranks (recomputed later, nothing lost)")
    sched.add_argument("--priority-aging-s", type=float, default=_default(SchedulerConfig, "priority_aging_s"),
                       help="seconds of waiting that raise a request's effective priority by 1 (no starvation)")
    sched.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                       help="plan each iteration only after the previous one's tokens reach the host")
    sched.add_argument("--dispatch-thread", action=argparse.BooleanOptionalAction,
                       default=_default(EngineConfig, "dispatch_thread"),
                       help="launch the programs on a thread of their own, beside the engine's planning")
    sched.add_argument("--fuse-decode-sampling", action=argparse.BooleanOptionalAction,
                       default=_default(SamplingConfig, "fuse_decode_sampling"),
                       help="plainly sampled decode batches sample inside their forward's program (one launch fewer)")

    kv = p.add_argument_group("KV cache")
    kv.add_argument("--page-size", type=int, default=_default(CacheConfig, "page_size"), help="tokens per KV page")
    kv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=_default(CacheConfig, "enable_prefix_caching"),
                    help="requests sharing a prefix (a system prompt, a chat's history) share its full KV pages")
    kv.add_argument("--num-kv-pages", type=int, default=None,
                    help="KV pool size in pages; sized from memory when not given (never more than "
                    "--max-num-seqs x --max-model-len can use)")
    kv.add_argument("--kv-cache-memory-gib", type=float, default=None,
                    help="KV pool size in GiB (capped as above); sized from device memory when not given")
    kv.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="as vLLM's: weights + KV + workspace take at most this fraction of each GPU (sets "
                    "XLA_PYTHON_CLIENT_MEM_FRACTION unless it is set); when not given, XLA's share (0.75 "
                    "unless that variable says otherwise)")

    par = p.add_argument_group("parallelism and compilation")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="ORCA inter-layer stages")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ORCA intra-layer split")
    par.add_argument("--coordinator-address", default=None,
                     help="several processes (jax.distributed): process 0's host:port; see docs/parallelism.md; one "
                     "process when not given")
    par.add_argument("--num-processes", type=int, default=1, help="controller processes (one per host or GPU)")
    par.add_argument("--process-id", type=int, default=0, help="0 serves HTTP and schedules; others mirror")
    par.add_argument("--control-port", type=int, default=None,
                     help="where process 0 takes the other processes' control connections (default: the "
                     "coordinator's port + 1); $ORCA_JAX_CONTROL_KEY, when set on every process, is their secret")
    par.add_argument("--peer-timeout-s", type=float, default=_default(ParallelConfig, "peer_timeout_s"),
                     help="a process silent this long is taken for dead and every process exits (one that "
                     "exits or crashes is noticed at once)")
    par.add_argument("--peer-shutdown-timeout-s", type=float, default=_default(ParallelConfig, "shutdown_timeout_s"),
                     help="how long a process that finished waits at exit for the others to finish too")
    par.add_argument("--attention-backend", choices=[b.value for b in AttentionBackend],
                     default=AttentionBackend.AUTO.value, help="auto: pallas on GPU, jnp elsewhere; pallas: the Pallas attention, RoPE + K/V "
                          "write and decode programs; pallas-attention: the Pallas attention only; jnp: no kernels")
    par.add_argument("--compilation-cache-dir", default="auto",
                     help="JAX's persistent compilation cache, so a second start is fast: 'auto' (a per-user "
                     "directory, $ORCA_JAX_CACHE_DIR or ~/.cache/orca_jax/xla), a path, or 'none' to turn it off")

    api = p.add_argument_group("API")
    api.add_argument("--host", default="127.0.0.1", help="address to bind")
    api.add_argument("--port", type=int, default=8000, help="port to bind")
    api.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1; $ORCA_API_KEY also works and keeps the "
                     "key out of the process list")
    api.add_argument("--metrics-require-auth", action="store_true", help="put /metrics behind the key too")
    api.add_argument("--allowed-hosts", default=None,
                     help="comma-separated Host header values to answer besides localhost's (checked when "
                     "bound to a loopback address, or whenever this is given); '*' turns the check off")
    api.add_argument("--allowed-origins", type=string_list, default=None,
                     help="CORS: origins whose web pages may call the API (JSON list or comma-separated; "
                     "'*' for any); none when not given, so no page elsewhere can read a local server's answers")
    api.add_argument("--allowed-methods", type=string_list, default="*", help="CORS: methods allowed")
    api.add_argument("--allowed-headers", type=string_list, default="*", help="CORS: request headers allowed")
    api.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    api.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    api.add_argument("--root-path", default=None,
                     help="the path prefix a proxy serves this under (ASGI root_path), e.g. /llm; none when "
                     "not given")
    api.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                     help="max_tokens of a chat request that names none, capped by the context left; 0: the "
                     "rest of the context (each such request then reserves KV for all of it)")
    api.add_argument("--allow-special-tokens-in-text", action="store_true",
                     help="let control tokens typed in prompts and messages (e.g. <|im_end|>) act as control "
                     "tokens; only for trusted callers, who can then forge conversation turns")
    api.add_argument("--shutdown-grace-seconds", type=float, default=0.0,
                     help="on SIGTERM, let in-flight requests run this long before aborting them")
    api.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="run the engine core in its own process, fed over a pipe, so the HTTP event loop and the "
                     "engine loop do not share one GIL (not yet with fine-tuning jobs or several processes); "
                     "default: on where --api-server-count's default is above 1, else off")
    api.add_argument("--data-parallel-size", type=int, default=1,
                     help="N whole replicas of the engine, each an engine core process on its own "
                     "tensor x pipeline GPUs (replica r gets CUDA_VISIBLE_DEVICES' slice r), behind this one "
                     "front end; a request goes to the replica holding its prompt's prefix, else the least "
                     "loaded (implies --engine-process)")
    api.add_argument("--api-server-count", type=int, default=None,
                     help="API server processes (each its own event loop, tokenizer and HTTP handling) on the one "
                     "port, each reaching every engine core (implies --engine-process); default: one per "
                     "data-parallel replica where the machine has two CPU cores for each; one engine on a GPU "
                     "4 where there are 4 cores for each (--no-engine-process keeps it on the one API server's "
                     "thread); else 1")

    tools = p.add_argument_group("tool calls")
    tools.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                       help='answer tool_choice "auto" (the default with tools): the model decides, and its '
                       "calls are read out of its text by the tool-call parser (on by default; "
                       "--no-enable-auto-tool-choice refuses such requests with 400)")
    tools.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model family's tool-call format: hermes (Qwen2.5, Hermes), llama3_json (Llama "
                       "3.1-3.3), mistral; also the format tool_choice \"required\" or a named function forces "
                       "(default: the one the chat template's markers name, else hermes)")

    limits, defaults = p.add_argument_group("HTTP limits (each refusal closes the connection)"), HTTPLimits()
    limits.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="request body size; larger get 413")
    limits.add_argument("--max-json-depth", type=_json_depth, default=DEFAULT_MAX_DEPTH,
                        help="how deeply a JSON body may nest arrays and objects (at most "
                        f"{MAX_DEPTH_LIMIT}); deeper get 400")
    limits.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes,
                        help="request line and headers together; larger get 431")
    limits.add_argument("--max-header-count", type=int, default=defaults.max_header_count,
                        help="header fields per request; more get 431")
    limits.add_argument("--max-url-bytes", type=int, default=defaults.max_url_bytes,
                        help="URL length; longer get 414")
    limits.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                        help="seconds from connecting (or a request's first byte) to its last header; then 408")
    limits.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                        help="seconds from the last header to the body's last byte; then 408")
    limits.add_argument("--keep-alive-timeout-s", type=float, default=defaults.keep_alive_timeout_s,
                        help="seconds an idle connection stays open between requests")
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="connections open at once; more get 503 + Retry-After as they connect")

    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="orca_jax's log level")
    logs.add_argument("--uvicorn-log-level", default=None, choices=(*LOG_LEVELS, "trace"),
                      help="uvicorn's log level; --log-level's when not given")
    logs.add_argument("--disable-uvicorn-access-log", action="store_true",
                      help="no line per HTTP request from uvicorn (health polling fills the log)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="no line per generation request (its id, prompt tokens and sampling settings)")
    add_grammar_arguments(p)
    add_lora_arguments(p)
    add_fine_tuning_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with --config's file read first, so that flags on the command line override it."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config", default=None)
    found, _ = finder.parse_known_args(argv)
    # argparse keeps the last value of a repeated flag: the command line's, after the file's.
    config_argv = [] if found.config is None else config_file_argv(parser, found.config)
    args = parser.parse_args(config_argv + argv)
    check_args(parser, args)
    return args


def config_file_argv(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a YAML file of `flag-name: value` pairs stands for (keys with - or _)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            settings = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as error:
        parser.error(f"--config {path}: {error}")
    if not isinstance(settings, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    argv: list[str] = []
    for key, value in settings.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None or option == "--config":
            parser.error(f"--config {path}: unknown flag {key!r}")
        if action.nargs == 0:  # a switch: true turns it on; false leaves it, or says --no-X
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} takes true or false, got {value!r}")
            if value:
                argv.append(option)
            elif isinstance(action, argparse.BooleanOptionalAction):
                argv.append("--no-" + option[2:])
        else:
            argv += [option, json.dumps(value) if isinstance(value, list) else str(value)]
    return argv


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag errors no single flag's type can see; each exits through parser.error."""
    if args.default_max_tokens < 0:
        parser.error("--default-max-tokens must be 0 (the rest of the context) or more")
    if args.api_server_count is not None and args.api_server_count < 1:
        parser.error("--api-server-count must be at least 1")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        parser.error("--root-path must start with / and not end with one, e.g. /llm")
    if (error := presets.model_source_error(args.model)) is not None:
        parser.error(error)
    try:
        template = read_chat_template(args.chat_template)
        if template is not None:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)  # syntax only
        engine_config_from_args(args)
        parse_lora_modules(args.lora_modules)
        http_limits_from_args(args)
        tool_call_settings_from_args(args)
        frontend_limits_from_args(args)
    except (ValueError, jinja2.TemplateSyntaxError) as error:
        parser.error(str(error))


def read_chat_template(value: str | None) -> str | None:
    """A template given as a file, or inline (what holds jinja's {{ or {%); ValueError otherwise."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not an inline jinja template")


def allowed_hosts_from_args(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The Host header values to answer, or None for any.

    A loopback server answers only to local names (DNS rebinding); one bound elsewhere answers to
    any unless --allowed-hosts names some.
    """
    extra = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    if "*" in extra:
        return None
    if args.host in ("127.0.0.1", "localhost", "::1") or args.host.startswith("127."):
        return LOCAL_HOSTS + (args.host,) + extra
    return extra or None


def tool_call_settings_from_args(args: argparse.Namespace) -> ToolCallSettings:
    return ToolCallSettings(parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)


def http_limits_from_args(args: argparse.Namespace) -> HTTPLimits:
    return HTTPLimits(max_header_bytes=args.max_header_bytes, max_header_count=args.max_header_count,
                      max_url_bytes=args.max_url_bytes, header_timeout_s=args.header_timeout_s,
                      body_timeout_s=args.body_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
                      max_connections=args.max_connections)


def long_prefill_token_threshold(given: int | None, max_num_batched_tokens: int) -> int | None:
    """The flag's value: None (not given) is a 1/LONG_PREFILL_SHARE of the budget, 0 no cap."""
    return SERVER_SCHEDULING.long_prefill_token_threshold(given, max_num_batched_tokens)


def engine_config_from_args(args: argparse.Namespace, defaults: BatchDefaults | None = None) -> EngineConfig:
    """Raises ValueError (from the configs' own checks) on inconsistent flags. `defaults`: the device's
    batch (engine.defaults.batch_defaults, known once jax has started); the CPU's when None."""
    defaults = defaults or batch_defaults_for("cpu", 0.0, UsageContext.SERVER)
    max_num_batched_tokens = args.max_num_batched_tokens or defaults.max_num_batched_tokens
    fine_tuning = fine_tuning_config_from_args(args)
    lora = lora_config_from_args(args)
    if fine_tuning is not None and lora is None:  # fine-tuned adapters are served from the LoRA slots
        lora = LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
    return EngineConfig(
        model=args.model,
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_kv_pages,
                          kv_memory_gib=args.kv_cache_memory_gib,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs or defaults.max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  long_prefill_token_threshold=long_prefill_token_threshold(
                                      args.long_prefill_token_threshold, max_num_batched_tokens),
                                  policy=SchedulingPolicy(args.scheduling_policy),
                                  max_waiting=args.max_waiting, async_scheduling=args.async_scheduling,
                                  kv_allocation=KVAllocation(args.kv_allocation),
                                  priority_preemption=args.priority_preemption,
                                  priority_aging_s=args.priority_aging_s),
        parallel=ParallelConfig(num_stages=args.pipeline_parallel_size,
                                tensor_parallel=args.tensor_parallel_size,
                                coordinator_address=args.coordinator_address,
                                num_processes=args.num_processes, process_id=args.process_id,
                                control_port=args.control_port, peer_timeout_s=args.peer_timeout_s,
                                shutdown_timeout_s=args.peer_shutdown_timeout_s),
        sampling=SamplingConfig(max_logprobs=args.max_logprobs, enable_prompt_logprobs=args.enable_prompt_logprobs,
                                max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                                fuse_decode_sampling=args.fuse_decode_sampling),
        attention=AttentionBackend(args.attention_backend),
        dtype=None if args.dtype == "auto" else args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        quantization=None if args.quantization is None else Quantization(args.quantization),
        quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=KVCacheDtype(args.kv_cache_dtype),
        dispatch_thread=args.dispatch_thread,
        compilation_cache_dir=None if args.compilation_cache_dir == "none" else args.compilation_cache_dir,
        lora=lora, fine_tuning=fine_tuning, grammar_limits=grammar_limits_from_args(args))
