"""The load generator of `bench serve`: streamed requests to any OpenAI-compatible server (asyncio + aiohttp).

Requests come from a dataset (datasets.py: the ORCA paper's lengths, Figure 11's, a ShareGPT-like mix)
or a JSONL file of prompts ("custom"), and are sent at Gamma/Poisson arrivals (vLLM's --request-rate
and --burstiness) or all at once. Every request streams, so the client sees each token chunk as it
lands (TTFT, inter-token latency). Output tokens come from the server's usage in the final chunk
(`stream_options.include_usage`) where it sends one, else from the number of token chunks. Arrival
gaps use datasets.arrival_times' seeded stream, so a run of the uniform dataset at rate R sends the
requests an in-process run of that trace would see, at the same times.

The client must cost less than the server it measures. aiohttp parses responses in C; httpx (h11,
pure Python) took about 110 us of CPU per streamed token and a third of a second to open 512
streams on a 2-core machine, which showed up as the server's time to first token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time

import aiohttp
import numpy as np

from orca_jax.bench.datasets import DatasetName, LengthSpec, arrival_times, make_trace
from orca_jax.bench.serve_stats import RequestRecord, Slo, summarize

CUSTOM = "custom"  # --dataset-name of a JSONL file of prompts


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
    burstiness: float = 1.0  # Gamma shape of the arrival gaps: 1 Poisson, inf evenly spaced
    dataset: DatasetName | None = DatasetName.UNIFORM  # None: prompts from dataset_path (custom)
    lengths: LengthSpec = LengthSpec()
    dataset_path: str | None = None
    endpoint: Endpoint = Endpoint.COMPLETIONS
    prompt_format: PromptFormat = PromptFormat.IDS
    vocab_size: int = 256  # token ids of IDS prompts are drawn below this
    custom_output_len: int | None = None  # custom prompts without max_tokens; None: none sent
    ignore_eos: bool = False  # vLLM's default; the paper's traces want it on
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
        if (self.dataset is None) == (self.dataset_path is None):
            raise ValueError("give exactly one of a dataset and a JSONL file of prompts")
        if self.endpoint is Endpoint.CHAT and self.dataset is not None and self.prompt_format is PromptFormat.IDS:
            raise ValueError("chat requests need text prompts: use prompt_format=text")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be positive, got {self.max_concurrency}")


@dataclasses.dataclass(frozen=True, slots=True)
class BenchRequest:
    """What one request sends: a prompt (text, ids or chat messages) and how many tokens to ask for."""

    prompt: str | list[int] | list[dict]
    max_tokens: int | None  # None: the request names none (the server's default applies)
    prompt_len: int | None


# Common short English words: a text prompt of n of them is roughly n tokens for BPE vocabularies.
_WORDS = ("the of and to in is was for that on as with by at from his it an were are which this be "
          "or has had not but first one their its new after who they have her she two been other "
          "when there all also into only time more some city may year over most world").split()


def build_requests(config: ServeBenchConfig) -> list[BenchRequest]:
    """The run's requests, in send order."""
    if config.dataset_path is not None:
        return _jsonl_requests(config)
    trace = make_trace(config.dataset, config.num_requests, None, config.seed, config.lengths)
    rng = np.random.default_rng([config.seed, 4])
    requests = []
    for index, spec in enumerate(trace.requests):
        if config.prompt_format is PromptFormat.IDS:
            prompt = trace.prompt_ids(index, config.vocab_size)
        else:
            prompt = " ".join(rng.choice(_WORDS, spec.prompt_len))
            if config.endpoint is Endpoint.CHAT:
                prompt = [{"role": "user", "content": prompt}]
        requests.append(BenchRequest(prompt, spec.max_tokens, spec.prompt_len))
    return requests


def _jsonl_requests(config: ServeBenchConfig) -> list[BenchRequest]:
    # One JSON object a line: {"prompt": "..."} or {"messages": [...]}, optionally "max_tokens".
    requests = []
    with open(config.dataset_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt = item["messages"] if config.endpoint is Endpoint.CHAT else item["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                want = "messages" if config.endpoint is Endpoint.CHAT else "prompt"
                raise ValueError(f"{config.dataset_path}:{number}: expected a JSON object with {want!r} ({err!r})") from err
            requests.append(BenchRequest(prompt, item.get("max_tokens") or config.custom_output_len, None))
            if len(requests) == config.num_requests:
                break
    if not requests:
        raise ValueError(f"{config.dataset_path}: no prompts")
    return requests


def _body(config: ServeBenchConfig, request: BenchRequest) -> dict:
    body = {"model": config.model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    if config.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension too; servers without it may refuse the field
    body["messages" if config.endpoint is Endpoint.CHAT else "prompt"] = request.prompt
    return body


def token_text(chunk: dict, endpoint: Endpoint) -> str | None:
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
                if token_text(chunk, config.endpoint) is not None:
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
    times = arrival_times(len(requests), config.request_rate, config.seed, config.burstiness)
    records = [RequestRecord(i, float(t), r.prompt_len, r.max_tokens) for i, (t, r) in enumerate(zip(times, requests))]
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
    return summarize(records, duration, config.slo), records


def records_json(records: list[RequestRecord]) -> list[dict]:
    """Per-request rows for the results file (times in seconds after the run's start)."""
    return [{"index": r.index, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s, "prompt_len": r.prompt_len,
             "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
             "ttft_s": r.ttft if r.ok else None, "latency_s": r.latency if r.ok else None,
             "tpot_s": r.tpot if r.ok else None, "error": r.error} for r in records]
