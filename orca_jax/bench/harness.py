"""What every bench subcommand shares: the results file, the engine from flags, random-weight models,
a launched server and its health, and the host replay of a schedule.

Results: one JSON per (model, subcommand) under --result-dir, stamped with the device, model, command
and commit that made it, and rewritten after every section, so a run cut short keeps what it measured.
Engine flags carry `python -m orca_jax.serve`'s names; `serve_flags` turns them back into a server's
command line, so a served engine and an in-process one are the same engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Iterator

import numpy as np

from orca_jax.config import (KVCacheDtype, Quantization, AttentionBackend, CacheConfig, EngineConfig, KVAllocation, ParallelConfig,
                             SamplingConfig, SchedulerConfig, SchedulingPolicy)
from orca_jax.bench.datasets import int_list, requested_lengths
from orca_jax.core.kv.manager import KVCacheManager
from orca_jax.engine.defaults import SERVER_SCHEDULING
from orca_jax.core.request import Request
from orca_jax.engine.defaults import UsageContext
from orca_jax.sampling_params import SamplingParams
from orca_jax.worker.executable_cache import source_digest
from orca_jax.worker.input_batch import BucketPolicy

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the results file --------------------------------------------------------------------------------


def add_result_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags: the JSON goes to --result-dir/--result-filename when --save-result or --result-dir."""
    group = parser.add_argument_group("results")
    group.add_argument("--save-result", action="store_true", help="write the result JSON")
    group.add_argument("--result-dir", default=None, help="where (default: the current directory)")
    group.add_argument("--result-filename", default=None, help="default: <model>_<subcommand>.json")


def source_commit() -> str:
    """$ORCA_JAX_COMMIT when set (a copy of the tree run elsewhere, whose own git state may be stale),
    else the checkout's commit (with -dirty when files differ), or 'unknown' outside a git checkout."""
    if os.environ.get("ORCA_JAX_COMMIT"):
        return os.environ["ORCA_JAX_COMMIT"]
    try:
        def git(*argv: str) -> str:
            return subprocess.run(["git", "-C", PACKAGE_DIR, *argv], capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--", PACKAGE_DIR) else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info() -> dict:
    """jax's first device (this starts jax's backend, which takes most of a GPU's memory)."""
    import jax

    first = jax.devices()[0]
    return {"device": first.device_kind, "platform": first.platform, "num_devices": jax.device_count(),
            "jax": jax.__version__}


def stamp(bench: str, model: str | None, command: str, device: dict | None = None) -> dict:
    """What made a result: subcommand, model, device (device_info() unless given), code, command, time."""
    import jax  # its version only: the backend (and the GPU's memory) is device_info()'s

    return {"bench": bench, "model": model, "jax": jax.__version__, **(device_info() if device is None else device),
            "commit": source_commit(), "source_digest": (source_digest() or "")[:12], "command": command,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


class Results(dict):
    """A subcommand's result: the stamp, the flags, then sections; saved after every `section`."""

    def __init__(self, bench: str, args: argparse.Namespace, model: str | None = None, device: dict | None = None):
        super().__init__(stamp(bench, model, args.command_line, device))
        self["args"] = {k: v for k, v in vars(args).items() if k not in ("handler", "command_line")}
        self.path = None
        if args.save_result or args.result_dir:
            directory = args.result_dir or "."
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, args.result_filename or f"{model or 'all'}_{bench}.json")
        self.save()

    def section(self, name: str, value) -> None:
        self[name] = value
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        with open(self.path + ".tmp", "w") as f:
            json.dump(self, f, indent=1, default=_json_default)
        os.replace(self.path + ".tmp", self.path)


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


# ---- the engine from flags ----------------------------------------------------------------------------

def on_off(value: bool | None) -> str | None:
    """A result's async_scheduling as the flag spells it (None: not recorded)."""
    return None if value is None else "on" if value else "off"


def _on_off_list(text: str) -> list[bool]:
    values = {"on": True, "off": False}
    try:
        return [values[x] for x in text.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {text!r}") from None


def add_engine_arguments(parser: argparse.ArgumentParser, *, model: str = "llama-8b",
                         lists: bool = False, server_defaults: bool = False) -> None:
    """The engine's flags, named as `python -m orca_jax.serve`'s; defaults are the device's and model's
    batch shape (engine/defaults.py, as `LLM` takes it: 64 sequences and 512 tokens per iteration on a
    CPU), bf16 random weights, and the library's scheduling (fcfs, ORCA's reservation). With lists,
    --max-num-seqs, --max-in-flight, --scheduling-policy and --async-scheduling take comma lists (every
    combination runs on one engine built for the largest). With server_defaults, the batch and the
    scheduling are serve's own where not given (None until resolve_server_defaults fills them for the
    device)."""
    from orca_jax.models.presets import describe_presets

    many = " (a comma list runs each)" if lists else ""
    served = " (default: what serve picks for the model and device)" if server_defaults else ""
    parser.set_defaults(server_defaults=server_defaults)
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=model, help=f"a preset ({describe_presets()}) or a model path")
    group.add_argument("--load-format", choices=["dummy", "auto"], default="dummy",
                       help="dummy: random weights of the model's shapes, bf16 unless --dtype (vLLM's name); "
                       "auto: the model's own weights where it has them")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="default: bfloat16 with dummy weights, else the model's")
    group.add_argument("--quantization", "-q", choices=[q.value for q in Quantization], default=None,
                       help="fp8: e4m3 projection weights (models/fp8.py)")
    group.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                       help="with --quantization, an untied LM head quantized too; off: in --dtype (the A/B)")
    group.add_argument("--kv-cache-dtype", choices=[d.value for d in KVCacheDtype], default="auto",
                       help="fp8: e4m3 KV pages")
    shape = served or " (default: the device's and model's, engine/defaults.py: {} on a CPU, {} on a GPU)"
    group.add_argument("--max-num-seqs", type=str if lists else int, default=None,
                       help="requests per iteration" + many + shape.format(64, "128-256"))
    group.add_argument("--max-num-batched-tokens", type=str if lists else int, default=None,
                       help="tokens per iteration" + (" (a comma list builds an engine for each)" if lists else "")
                       + shape.format(512, "2048-8192"))
    group.add_argument("--max-waiting", type=int, default=None if server_defaults else 4096,
                       help="requests queued at most" + served)
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context in tokens (default: the model's); the dataset's lengths are fitted to it")
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    group.add_argument("--num-kv-pages", type=int, default=None, help="KV pool in pages")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="requests sharing a prefix share its KV pages (each trace run starts with none cached)")
    group.add_argument("--kv-cache-memory-gib", type=float, default=None,
                       help="KV pool in GiB (default: the runner's share of free memory)")
    group.add_argument("--attention-backend", choices=[b.value for b in AttentionBackend],
                       default=AttentionBackend.AUTO.value, help="the forward's kernels: auto, pallas (attention, RoPE + K/V write, decode "
                       "programs), pallas-attention (the attention kernel only), jnp")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices each layer is split over")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    group.add_argument("--scheduling-policy", default=None if server_defaults else SchedulingPolicy.FCFS.value,
                       help=", ".join(p.value for p in SchedulingPolicy) + many + served)
    group.add_argument("--kv-allocation", choices=[k.value for k in KVAllocation],
                       default=None if server_defaults else KVAllocation.RESERVE.value,
                       help="reserve: ORCA's, a request's whole KV when it starts; on_demand: as it grows" + served)
    group.add_argument("--async-scheduling", type=_on_off_list, default=[True],
                       help="plan iteration k+1 while k runs: on, off" + (" or on,off" if lists else ""))
    if lists:
        group.add_argument("--max-in-flight", type=str, default=None,
                           help="batches in flight (default: one per stage, two with async scheduling)" + many)
    group.add_argument("--dispatch-thread", action=argparse.BooleanOptionalAction, default=True,
                       help="launch the programs on a thread of their own, beside the engine's planning")
    group.add_argument("--fuse-decode-sampling", action=argparse.BooleanOptionalAction, default=True,
                       help="plainly sampled decode batches sample inside their forward's program")
    group.add_argument("--compilation-cache-dir", default="auto", help="a path, 'auto' or 'none'")
    group.add_argument("--engine-seed", type=int, default=0, help="random weights' and sampling's seed")


def context_len(args: argparse.Namespace) -> int | None:
    """The context a request must fit: --max-model-len, else the model's own (None: a model we cannot read,
    such as another server's)."""
    if getattr(args, "max_model_len", None):
        return args.max_model_len
    from orca_jax.models.presets import PRESETS

    if args.model in PRESETS:
        return PRESETS[args.model].max_seq_len
    if os.path.exists(args.model):
        from orca_jax.models.loader import read_model_config

        return read_model_config(args.model).max_seq_len
    return None


def fit_to_context(args: argparse.Namespace) -> None:
    """Before anything compiles: the requests the flags ask for, fitted to the model's context (a request
    that does not fit would end the run after the compiling); one line per change, naming the flags.
    Sets args.context_len, which lengths_from_args reads."""
    if not hasattr(args, "model") or (limit := context_len(args)) is None:
        return
    args.context_len = limit
    notes = []
    if hasattr(args, "uniform_input_range"):
        _, changed = requested_lengths(args).fit(limit)
        named = {name.strip() for name in str(getattr(args, "dataset_name", "")).split(",")}
        notes += [note for dataset, note in changed.items() if dataset.value in named]
    if hasattr(args, "input_len") and args.input_len + args.output_len > limit:  # bench latency's one shape
        before = (args.input_len, args.output_len)
        args.input_len = min(max(limit - args.output_len, limit // 2), limit - 1)
        args.output_len = min(args.output_len, limit - args.input_len)
        notes.append(f"--input-len {before[0]} --output-len {before[1]} shortened to {args.input_len} and "
                     f"{args.output_len}")
    for note in notes:
        print(f"bench: {args.model}'s context is {limit} tokens (--max-model-len): {note}", file=sys.stderr,
              flush=True)


def fill_batch_defaults(args: argparse.Namespace, usage: UsageContext = UsageContext.OFFLINE) -> None:
    """--max-num-seqs and --max-num-batched-tokens left open: the device's and the model's defaults, as
    LLM (offline) or the server (usage SERVER) would take them. Starts jax."""
    if args.max_num_seqs is not None and args.max_num_batched_tokens is not None:
        return
    from orca_jax.engine.defaults import batch_defaults
    from orca_jax.models.loader import read_model_config

    defaults = batch_defaults(usage, read_model_config(args.model).num_params)
    args.max_num_seqs = args.max_num_seqs or defaults.max_num_seqs
    args.max_num_batched_tokens = args.max_num_batched_tokens or defaults.max_num_batched_tokens
    print(f"bench: --max-num-seqs {args.max_num_seqs} --max-num-batched-tokens {args.max_num_batched_tokens} "
          f"(the device's defaults where not given, engine/defaults.py)", file=sys.stderr, flush=True)


def engine_config(args: argparse.Namespace, *, max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None, **overrides) -> EngineConfig:
    """The EngineConfig the flags describe; max_num_seqs: the largest a later run asks for;
    max_num_batched_tokens: this engine's of a list of budgets. Open batch flags take the device's defaults."""
    fill_batch_defaults(args)
    seqs = max_num_seqs or largest_int(args.max_num_seqs)
    cache_dir = args.compilation_cache_dir
    budget = max_num_batched_tokens or first_int(args.max_num_batched_tokens)
    # serve's own scheduling (resolve_server_defaults filled the rest): its cap on a prompt's share and
    # priority preemption; the bench's own: no cap, none.
    served = {"long_prefill_token_threshold": SERVER_SCHEDULING.long_prefill_token_threshold(None, budget),
              "priority_preemption": SERVER_SCHEDULING.priority_preemption} if args.server_defaults else {}
    return EngineConfig(
        model=args.model, dtype=model_dtype(args),
        cache=CacheConfig(page_size=args.page_size, num_pages=args.num_kv_pages, kv_memory_gib=args.kv_cache_memory_gib,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                  max_waiting=args.max_waiting, async_scheduling=args.async_scheduling[0],
                                  policy=SchedulingPolicy(args.scheduling_policy.split(",")[0]),
                                  kv_allocation=KVAllocation(args.kv_allocation), **served),
        parallel=ParallelConfig(num_stages=args.pipeline_parallel_size, tensor_parallel=args.tensor_parallel_size),
        attention=AttentionBackend(args.attention_backend), max_model_len=args.max_model_len, seed=args.engine_seed,
        quantization=None if args.quantization is None else Quantization(args.quantization),
        quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=KVCacheDtype(args.kv_cache_dtype),
        dispatch_thread=args.dispatch_thread, sampling=SamplingConfig(fuse_decode_sampling=args.fuse_decode_sampling),
        compilation_cache_dir=None if cache_dir == "none" else cache_dir, **overrides)


def largest_int(value: int | str) -> int:
    """An int flag's value, or the largest of a comma list."""
    return value if isinstance(value, int) else max(int(x) for x in str(value).split(","))


def first_int(value: int | str) -> int:
    """An int flag's value, or the first of a comma list."""
    return value if isinstance(value, int) else int(str(value).split(",")[0])


def model_dtype(args: argparse.Namespace) -> str | None:
    return args.dtype or ("bfloat16" if args.load_format == "dummy" else None)


def random_model(model: str, dtype: str | None = "bfloat16"):
    """A preset's shapes with params None (the runner draws them on device) and a byte tokenizer: GPU
    runs use random weights for every model, the paper's practice (SmolLM2's file is not there)."""
    from orca_jax.models.loader import LoadedModel
    from orca_jax.models.presets import get_preset
    from orca_jax.tokenizer import ByteTokenizer

    config = get_preset(model)
    config = dataclasses.replace(config, dtype=dtype or config.dtype)
    return LoadedModel(config, None, ByteTokenizer(config.eos_token_ids, config.bos_token_id))


def build_engine(args: argparse.Namespace, **overrides):
    """An Engine as the flags describe it (every program compiled before it returns)."""
    from orca_jax.engine import Engine

    loaded = random_model(args.model, model_dtype(args)) if args.load_format == "dummy" else None
    return Engine(engine_config(args, **overrides), loaded)


def measured_engine(args: argparse.Namespace, results: Results, peaks=None, **overrides):
    """(engine, peaks, model costs per device of its mesh): the device's peaks measured first (unless given), before the engine
    sizes its KV pool from the memory left; the engine's shape, start-up seconds, the peaks and the
    weight-read bound go to results."""
    from orca_jax.bench import roofline

    peaks = peaks or roofline.measure_peaks()
    start = time.perf_counter()
    engine = build_engine(args, **overrides)
    stats = engine.stats()
    results.section("engine", {"num_compiled_programs": stats.num_compiled_programs, "kv_pages": stats.kv_pages_total,
                               "start_s": time.perf_counter() - start,
                               "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
                               "params_bytes": engine.runner.params_bytes, "num_devices": engine.runner.num_devices,
                               "peaks": peaks.as_dict(),
                               "weight_bound_ms": 1e3 * roofline.weight_read_seconds(engine.runner, peaks)})
    return engine, peaks, roofline.ModelCosts.of(engine.model_config).per_device(engine.runner.num_devices)


def _engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags the bench and the server share, for the engine these flags build (first of any list);
    with server_defaults, only those given."""
    seqs, budget, policy = args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy
    values = [("--model", args.model), ("--dtype", model_dtype(args)),
              ("--max-num-seqs", None if seqs is None else largest_int(seqs)),
              ("--max-num-batched-tokens", None if budget is None else first_int(budget)), ("--max-waiting", args.max_waiting),
              ("--max-model-len", args.max_model_len), ("--page-size", args.page_size),
              ("--num-kv-pages", args.num_kv_pages), ("--kv-cache-memory-gib", args.kv_cache_memory_gib),
              ("--attention-backend", args.attention_backend), ("--tensor-parallel-size", args.tensor_parallel_size),
              ("--pipeline-parallel-size", args.pipeline_parallel_size),
              ("--scheduling-policy", None if policy is None else policy.split(",")[0]),
              ("--kv-allocation", args.kv_allocation), ("--quantization", args.quantization),
              ("--kv-cache-dtype", args.kv_cache_dtype), ("--compilation-cache-dir", args.compilation_cache_dir)]
    switches = ["--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
                "--quantize-lm-head" if args.quantize_lm_head else "--no-quantize-lm-head",
                "--dispatch-thread" if args.dispatch_thread else "--no-dispatch-thread",
                "--fuse-decode-sampling" if args.fuse_decode_sampling else "--no-fuse-decode-sampling"]
    return [str(x) for flag, value in values if value is not None for x in (flag, value)] + switches


def engine_argv(args: argparse.Namespace) -> list[str]:
    """Bench flags that build the same engine in a child process."""
    return _engine_flags(args) + ["--load-format", args.load_format, "--engine-seed", str(args.engine_seed),
                                  "--async-scheduling", "on" if args.async_scheduling[0] else "off"]


def serve_flags(args: argparse.Namespace, port: int) -> list[str]:
    """`python -m orca_jax.serve`'s flags for the engine the same flags build in process: the bench's
    scheduling (the server's own defaults differ: priority scheduling, on-demand KV, a cap on long prompts'
    chunks), or with server_defaults the server's own and only the flags given. The server loads the model
    as `--load-format auto` would: random weights for every preset but SmolLM2."""
    bench_scheduling = [] if args.server_defaults else ["--no-priority-preemption", "--long-prefill-token-threshold", "0"]
    return _engine_flags(args) + ["--port", str(port), "--seed", str(args.engine_seed), "--log-level", "warning",
                                  *bench_scheduling] + ([] if args.async_scheduling[0] else ["--no-async-scheduling"])


# ---- a launched server --------------------------------------------------------------------------------

COMPILED = re.compile(r"^orca_jax:num_compiled_programs\{[^}]*\} ([0-9.e+]+)$", re.M)


def compiled_programs(base_url: str) -> int:
    """The server's program count, from /metrics."""
    import httpx

    return int(float(COMPILED.search(httpx.get(f"{base_url}/metrics", timeout=10).text).group(1)))


def wait_for_healthy(base_url: str, process: subprocess.Popen | None = None, timeout_s: float = 600.0) -> float:
    """Seconds until /health answers 200 (the server answers 503 while it compiles); raises if the
    process exits first or the time runs out."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.25)
    raise TimeoutError(f"{base_url} was not ready within {timeout_s:.0f} s")


@contextlib.contextmanager
def launched_server(flags: list[str], port: int, log_path: str | None,
                    timeout_s: float = 600.0) -> Iterator[dict]:
    """`python -m orca_jax.serve FLAGS` in a child process until the block ends; yields its base URL,
    command and start-up seconds once /health says every program is compiled."""
    cmd = [sys.executable, "-m", "orca_jax.serve", *flags]
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path or os.devnull, "w") as log:
        started = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_healthy(base_url, server, timeout_s)
            yield {"base_url": base_url, "command": " ".join(cmd), "process_to_ready_s": time.perf_counter() - started}
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


# ---- the host replay of a schedule ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class ReplayedIteration:
    """One iteration of a schedule replayed on the host: what each request fed and read."""

    q_lens: np.ndarray  # i64[S] tokens each request feeds
    kv_lens: np.ndarray  # i64[S] its context once they are in
    padded_tokens: int  # T of the bucket the batch lands in

    @property
    def attn_pairs(self) -> int:
        """Causal (query, key) pairs: each query sees its context up to itself."""
        q, k = self.q_lens, self.kv_lens
        return int((q * k - q * (q - 1) // 2).sum())


def replay_schedule(factory: Callable, lengths: list[tuple[int, int]], buckets: BucketPolicy, page_size: int = 16,
                    max_model_len: int | None = None, num_pages: int | None = None) -> list[ReplayedIteration]:
    """Run a scheduler (factory(kv, max_model_len, max_in_flight) as Engine takes) over requests of
    (prompt, max_tokens) lengths, all at time 0, with every sampled token ignored and one batch in
    flight. An engine's max_model_len and pool make its own schedule; by default the pool holds every
    request, so only the scheduler's own limits shape the batches."""
    max_len = max_model_len or max(p + g for p, g in lengths)
    kv = KVCacheManager(num_pages or len(lengths) * -(-max_len // page_size) + 1, page_size)
    scheduler = factory(kv, max_len, 1)
    for i, (prompt, gen) in enumerate(lengths):
        scheduler.add_request(Request(str(i), [5] * prompt, SamplingParams(max_tokens=gen, ignore_eos=True),
                                      arrival_time=float(i)))
    iterations = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        q = np.array([s.num_new_tokens for s in output.scheduled], np.int64)
        k = np.array([s.request.num_computed_tokens for s in output.scheduled], np.int64) + q
        iterations.append(ReplayedIteration(q, k, buckets.bucket(int(q.sum()), len(q), 1).tokens))
        scheduler.update(output, [7] * output.num_requests)
    return iterations
