"""`python -m orca_jax.bench serve`: a load generator for any OpenAI-compatible server (asyncio + aiohttp).

Requests come from a trace (the ORCA paper's uniform lengths, a ShareGPT-like mix: see traces.py) or a
JSONL file of prompts, and are sent at Poisson or fixed-rate arrivals, or all at once. Every request
streams, so the client sees each token chunk as it lands (TTFT, inter-token latency). Output tokens
come from the server's usage in the final chunk (`stream_options.include_usage`) where it sends one,
else from the number of token chunks. Poisson gaps use the same seeded stream as traces.make_trace,
so `--trace uniform --seed S --request-rate R` sends the requests an in-process run of that trace
would see, at the same times.

The client must cost less than the server it measures. aiohttp parses responses in C; httpx (h11,
pure Python) took about 110 us of CPU per streamed token and a third of a second to open 512
streams on a 2-core machine, which showed up as the server's time to first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import math
import time

import aiohttp
import numpy as np

from orca_jax.bench.serve_stats import RequestRecord, Slo, summarize
from orca_jax.bench.traces import LengthSpec, TraceKind, make_trace


class Arrivals(enum.Enum):
    POISSON = "poisson"
    FIXED = "fixed"  # one request every 1 / rate seconds


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


class PromptFormat(enum.Enum):
    IDS = "ids"  # token ids (exact lengths; /v1/completions only)
    TEXT = "text"  # words, about one token each, for any endpoint


@dataclasses.dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    """One run against one server."""

    base_url: str
    model: str
    num_requests: int = 64
    request_rate: float | None = None  # requests per second; None: all at once
    arrivals: Arrivals = Arrivals.POISSON
    trace: TraceKind | None = TraceKind.UNIFORM  # None: prompts from jsonl
    lengths: LengthSpec = LengthSpec()  # the trace's length distributions
    jsonl: str | None = None
    endpoint: Endpoint = Endpoint.COMPLETIONS
    prompt_format: PromptFormat = PromptFormat.IDS
    vocab_size: int = 256  # token ids of IDS prompts are drawn below this
    max_tokens: int | None = None  # overrides the trace's lengths (and is the JSONL default)
    ignore_eos: bool = True  # the paper's traces generate exactly max_tokens
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    slo: Slo = Slo()

    def __post_init__(self):
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or None: all at once), got {self.request_rate}")
        if (self.trace is None) == (self.jsonl is None):
            raise ValueError("give exactly one of a trace and a JSONL file of prompts")
        if self.endpoint is Endpoint.CHAT and self.trace is not None and self.prompt_format is PromptFormat.IDS:
            raise ValueError("chat requests need text prompts: use prompt_format=text")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be positive, got {self.max_concurrency}")


@dataclasses.dataclass(frozen=True, slots=True)
class BenchRequest:
    """What one request sends: a prompt (text, ids or chat messages) and how many tokens to ask for."""

    prompt: str | list[int] | list[dict]
    max_tokens: int
    prompt_len: int | None


# Common short English words: a text prompt of n of them is roughly n tokens for BPE vocabularies.
_WORDS = ("the of and to in is was for that on as with by at from his it an were are which this be "
          "or has had not but first one their its new after who they have her she two been other "
          "when there all also into only time more some city may year over most world").split()


def arrival_times(n: int, rate: float | None, arrivals: Arrivals, seed: int) -> np.ndarray:
    """f64[n] seconds after the start; Poisson gaps as traces.make_trace draws them."""
    if rate is None or math.isinf(rate):
        return np.zeros(n)
    if arrivals is Arrivals.FIXED:
        return np.arange(n) / rate
    gaps = np.random.default_rng([seed, 2]).standard_exponential(n) / rate
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_requests(config: ServeBenchConfig) -> list[BenchRequest]:
    """The run's requests, in send order."""
    if config.jsonl is not None:
        return _jsonl_requests(config)
    trace = make_trace(config.trace, config.num_requests, None, config.seed, config.lengths)
    rng = np.random.default_rng([config.seed, 4])
    requests = []
    for index, spec in enumerate(trace.requests):
        if config.prompt_format is PromptFormat.IDS:
            prompt = trace.prompt_ids(index, config.vocab_size)
        else:
            prompt = " ".join(rng.choice(_WORDS, spec.prompt_len))
            if config.endpoint is Endpoint.CHAT:
                prompt = [{"role": "user", "content": prompt}]
        requests.append(BenchRequest(prompt, config.max_tokens or spec.max_tokens, spec.prompt_len))
    return requests


def _jsonl_requests(config: ServeBenchConfig) -> list[BenchRequest]:
    # One JSON object a line: {"prompt": "..."} or {"messages": [...]}, optionally "max_tokens".
    requests = []
    with open(config.jsonl, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["messages"] if config.endpoint is Endpoint.CHAT else item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                want = "messages" if config.endpoint is Endpoint.CHAT else "prompt"
                raise ValueError(f"{config.jsonl}:{number}: expected a JSON object with {want!r} ({err!r})") from err
            max_tokens = int(item.get("max_tokens") or config.max_tokens or 128)
            requests.append(BenchRequest(prompt, max_tokens, None))
            if len(requests) == config.num_requests:
                break
    if not requests:
        raise ValueError(f"{config.jsonl}: no prompts")
    return requests


def _body(config: ServeBenchConfig, request: BenchRequest) -> dict:
    body = {"model": config.model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension too; servers without it may refuse the field
    body["messages" if config.endpoint is Endpoint.CHAT else "prompt"] = request.prompt
    return body


def _token_text(chunk: dict, endpoint: Endpoint) -> str | None:
    """The text a stream chunk carries, or None when it carries no token (role, usage, finish)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if endpoint is Endpoint.CHAT else choice.get("text")
    if not text and choice.get("finish_reason") is not None:
        return None  # the closing chunk
    if endpoint is Endpoint.CHAT and text is None:
        return None  # the opening role-only chunk
    return text or ""


async def send_one(session: aiohttp.ClientSession, config: ServeBenchConfig, request: BenchRequest,
                   record: RequestRecord, start: float) -> None:
    """Stream one request, filling `record` (times relative to `start`); never raises for HTTP errors."""
    path = "/v1/chat/completions" if config.endpoint is Endpoint.CHAT else "/v1/completions"
    record.sent_s = time.perf_counter() - start
    chunks = 0
    try:
        async with session.post(config.base_url.rstrip("/") + path, json=_body(config, request)) as response:
            if response.status != 200:
                detail = (await response.read()).decode("utf-8", "replace")[:200]
                record.error = f"HTTP {response.status}: {detail}"
                return
            async for raw in response.content:  # one line at a time; events end with a blank line
                if not raw.startswith(b"data:"):
                    continue
                data = raw[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter() - start
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"stream error: {chunk['error']}"
                    return
                if _token_text(chunk, config.endpoint) is not None:
                    record.chunk_s.append(now)
                    chunks += 1
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"]["completion_tokens"])
                    record.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    record.usage_reported = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, ValueError) as err:
        record.error = f"{type(err).__name__}: {err}"
        return
    finally:
        record.end_s = time.perf_counter() - start
    if not record.usage_reported:
        record.output_tokens = chunks
    if not record.chunk_s:
        record.error = "no tokens came back"


# A stream line may be long (a chunk with many logprobs). aiohttp refuses lines over twice its read
# buffer, 128 KiB by default; this makes that 2 MiB.
READ_BUFFER_BYTES = 1 << 20


async def run(config: ServeBenchConfig, progress: bool = True) -> tuple[dict, list[RequestRecord]]:
    """Send every request at its arrival time; returns (summary, per-request records)."""
    from tqdm.auto import tqdm

    requests = build_requests(config)
    times = arrival_times(len(requests), config.request_rate, config.arrivals, config.seed)
    records = [RequestRecord(i, float(t), r.prompt_len, r.max_tokens) for i, (t, r) in
               enumerate(zip(times, requests))]
    limit = asyncio.Semaphore(config.max_concurrency or len(requests))
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)  # 0: no limit but the semaphore's
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

    async with aiohttp.ClientSession(headers=headers, connector=connector, read_bufsize=READ_BUFFER_BYTES,
                                     timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as session:
        start = time.perf_counter()

        async def one(request: BenchRequest, record: RequestRecord) -> None:
            delay = record.scheduled_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                await send_one(session, config, request, record, start)
            bar.update(1)

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records)))
        duration = time.perf_counter() - start
    bar.close()
    summary = summarize(records, duration, config.slo)
    summary["config"] = _describe(config)
    return summary, records


def _describe(config: ServeBenchConfig) -> dict:
    fields = dataclasses.asdict(config)
    fields.pop("api_key")
    for key, value in fields.items():
        if isinstance(value, enum.Enum):
            fields[key] = value.value
    return fields


def records_json(records: list[RequestRecord]) -> list[dict]:
    """Per-request rows for the results file (times in seconds after the run's start)."""
    return [{"index": r.index, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "prompt_len": r.prompt_len,
             "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
             "ttft_s": r.ttft if r.ok else None, "latency_s": r.latency if r.ok else None,
             "tpot_s": r.tpot if r.ok else None, "error": r.error} for r in records]


# --- command line ---------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    """`bench serve`'s flags (names as vLLM's `bench serve` where there is one)."""
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server expects")
    parser.add_argument("--endpoint", choices=[e.value for e in Endpoint], default=Endpoint.COMPLETIONS.value)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf sends all at once")
    parser.add_argument("--arrivals", choices=[a.value for a in Arrivals], default=Arrivals.POISSON.value)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", choices=[t.value for t in TraceKind], default=TraceKind.UNIFORM.value,
                        help="uniform: the ORCA paper's lengths; sharegpt: a ShareGPT-like lognormal mix")
    source.add_argument("--dataset-jsonl", default=None, help='lines {"prompt": ...} or {"messages": [...]}')
    parser.add_argument("--input-len", type=int, default=LengthSpec().homogeneous[0],
                        help="prompt tokens of the homogeneous trace")
    parser.add_argument("--output-len", type=int, default=LengthSpec().homogeneous[1],
                        help="output tokens of the homogeneous trace")
    parser.add_argument("--prompt-format", choices=[p.value for p in PromptFormat], default=None,
                        help="trace prompts as token ids (completions default) or words (chat default)")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids of id prompts stay below this")
    parser.add_argument("--max-tokens", type=int, default=None, help="override the trace's output lengths")
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--api-key", default=None, help="or $OPENAI_API_KEY")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2e-ms", type=float, default=None)
    parser.add_argument("--out", default=None, help="write the summary and per-request rows as JSON")
    parser.add_argument("--plot", default=None, help="write TTFT/TPOT plots as PNG (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args) -> ServeBenchConfig:
    import os

    endpoint = Endpoint(args.endpoint)
    default_format = PromptFormat.TEXT if endpoint is Endpoint.CHAT else PromptFormat.IDS
    return ServeBenchConfig(
        base_url=args.base_url, model=args.model, num_requests=args.num_prompts,
        request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        arrivals=Arrivals(args.arrivals), trace=None if args.dataset_jsonl else TraceKind(args.trace),
        lengths=LengthSpec(homogeneous=(args.input_len, args.output_len)), jsonl=args.dataset_jsonl,
        endpoint=endpoint,
        prompt_format=PromptFormat(args.prompt_format) if args.prompt_format else default_format,
        vocab_size=args.vocab_size, max_tokens=args.max_tokens, ignore_eos=not args.no_ignore_eos,
        max_concurrency=args.max_concurrency, seed=args.seed, timeout_s=args.timeout_s,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, e2e_ms=args.slo_e2e_ms))


def main(args) -> dict:
    """Run, print the summary table, write --out and --plot; returns the summary."""
    from orca_jax.bench.serve_stats import format_summary, plot

    config = config_from_args(args)
    summary, records = asyncio.run(run(config, progress=not args.no_progress))
    print(format_summary(summary))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "requests": records_json(records)}, f, indent=1)
    if args.plot and not plot(records, args.plot, f"{config.model} @ {config.base_url}"):
        print("no plot: matplotlib is not installed or no request completed")
    return summary
