"""Helpers for the server tests: a fake engine you can check by hand, and ways to run an app.

FakeEngine follows JetStream's mock engine: no model, just arithmetic. Each generated token is the
letter after the previous token ('a'..'z', wrapping), so a prompt ending in "e" continues "fghij...";
or, given a `reply` (ASCII), each request generates its bytes and then stops as at EOS.
It keeps the real Engine's contract (add_request/abort/step/has_unfinished/stats, ValueError and
QueueFullError, ORCA's KV reservation of all max_tokens on first scheduling, priority order), so the
server's orchestration can be tested exactly and fast. Real-engine tests live in
server/test_engine.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from orca_jax.config import CacheConfig, EngineConfig, ModelConfig, ModelFamily, SchedulerConfig
from orca_jax.core.sched.interface import QueueFullError
from orca_jax.engine import EngineStats
from orca_jax.outputs import RequestOutput, TokenLogprob
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.http_limits import HTTPLimits
from orca_jax.server.in_thread import ServedApp, served_in_thread
from orca_jax.tokenizer import ByteTokenizer, Tokenizer, byte_to_unicode

FIRST_LETTER, NUM_LETTERS = ord("a"), 26
EOS = 2


def next_letter(token: int) -> int:
    return FIRST_LETTER + (token - FIRST_LETTER + 1) % NUM_LETTERS


def expected_text(prompt: str, num_tokens: int) -> str:
    """What FakeEngine generates for `prompt` (byte tokens) in `num_tokens` steps."""
    token, letters = prompt.encode()[-1], []
    for _ in range(num_tokens):
        token = next_letter(token)
        letters.append(chr(token))
    return "".join(letters)


@dataclasses.dataclass(slots=True)
class _FakeRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    priority: int
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    pages: int = 0


class FakeEngine:
    """Deterministic stand-in for orca_jax.engine.Engine (see the module docstring)."""

    def __init__(self, *, max_num_seqs: int = 8, max_waiting: int = 64, num_pages: int = 256,
                 page_size: int = 4, max_model_len: int = 128, step_seconds: float = 0.0,
                 fail_at_iteration: int | None = None, tokenizer=None, reply: str | None = None):
        self.config = EngineConfig(
            model="fake", cache=CacheConfig(page_size=page_size, num_pages=num_pages),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                      max_num_batched_tokens=max(512, max_num_seqs)))
        self.model_config = ModelConfig(
            family=ModelFamily.LLAMA, vocab_size=tokenizer.vocab_size if tokenizer else 256, hidden_size=8, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=8, ffn_size=8, max_seq_len=max_model_len, eos_token_ids=(EOS,))
        self.tokenizer = tokenizer or ByteTokenizer(eos_token_ids=(EOS,), bos_token_id=1)
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.reply = reply
        self.fail_at_iteration = fail_at_iteration
        self.num_pages = num_pages
        self.page_size = page_size
        self.waiting: list[_FakeRequest] = []
        self.running: dict[str, _FakeRequest] = {}
        self.aborted: list[str] = []
        self.aborted_at_iteration: dict[str, int] = {}
        self.thread_ids: set[int] = set()  # which threads called in; must be exactly one
        self.num_calls = 0  # grows while anyone polls the engine
        self.priorities: list[int] = []  # of every request added, in order
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []  # of every request added, in order
        self._stats = EngineStats(kv_pages_total=num_pages)
        self.compile_gate: threading.Event | None = None  # precompile() waits on it when set
        self._arrivals = 0

    def _enter(self) -> None:
        self.thread_ids.add(threading.get_ident())
        self.num_calls += 1

    lora = None  # no LoRA adapters (Engine.lora)
    fine_tuning = None  # no fine-tuning jobs (Engine.fine_tuning)
    grammar_compiler = None  # no grammars: the server checks constraints in its workers, compiles none

    def list_loras(self) -> list:
        return []

    def add_request(self, prompt: str | list[int], sampling: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, deadline: float | None = None, lora_request=None, grammar=None) -> str:
        self._enter()
        if lora_request is not None:
            raise ValueError("the fake engine serves no LoRA adapters")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or not all(0 <= t < self.model_config.vocab_size for t in ids):
            raise ValueError("prompt must be non-empty ids in the vocabulary")
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens > max_model_len ({self.max_model_len})")
        if self._pages_for(len(ids) + sampling.max_tokens) > self.num_pages:
            raise ValueError("request is bigger than the KV pool")
        if len(self.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError("fake pool full")
        request_id = request_id or f"fake-{self._arrivals}"
        self._arrivals += 1
        self.priorities.append(priority)
        self.prompts.append(ids)
        self.samplings.append(sampling)
        self.waiting.append(_FakeRequest(request_id, ids, sampling, priority, self._arrivals))
        self._stats.prompt_tokens_total += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        self._enter()
        self.aborted.append(request_id)
        self.aborted_at_iteration[request_id] = self._stats.iterations
        if self.running.pop(request_id, None) is not None:
            return True
        before = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        return len(self.waiting) < before

    def reset_prefix_cache(self) -> int:
        self._enter()
        return 0  # nothing is cached here

    def drain(self) -> None:
        self._enter()  # it launches nothing: nothing to wait for

    def has_unfinished(self) -> bool:
        self._enter()
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        return self.has_unfinished()  # no fine-tuning jobs

    def step(self) -> list[RequestOutput]:
        self._enter()
        self._admit()
        if not self.running:
            return []
        if self.fail_at_iteration is not None and self._stats.iterations >= self.fail_at_iteration:
            raise RuntimeError("fake engine failure")
        start = time.perf_counter()
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outputs = [self._advance(r) for r in list(self.running.values())]
        stats = self._stats
        stats.iterations += 1
        stats.last_batch_size = len(outputs)
        stats.last_num_tokens = len(outputs)
        stats.last_iteration_seconds = time.perf_counter() - start
        return outputs

    def precompile(self, progress=None):
        """Engine.precompile's contract: report each "program"; waits on `compile_gate` if one is set."""
        from orca_jax.worker.model_runner import PrecompileReport

        from orca_jax.worker.precompile_progress import PrecompilePhase, PrecompileProgress

        for done in range(1, 4):
            if self.compile_gate is not None:
                self.compile_gate.wait(10)
            if progress is not None:
                progress(PrecompileProgress(PrecompilePhase.COMPILING, done, 3, 0.0, ("forward", done)))
        return PrecompileReport(3, 0.0, 0.0)

    @property
    def num_iterations(self) -> int:
        """For tests to read from any thread (a plain int; stats() would count as an engine call)."""
        return self._stats.iterations

    def stats(self) -> EngineStats:
        self._enter()
        stats = dataclasses.replace(self._stats)
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.kv_pages_used = sum(r.pages for r in self.running.values())
        stats.kv_pages_reserved = stats.kv_pages_used  # as the engine counts: held plus promised (all held here)
        return stats

    # ---- internals ----

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _admit(self) -> None:
        self.waiting.sort(key=lambda r: (-r.priority, r.arrival))
        free = self.num_pages - sum(r.pages for r in self.running.values())
        while self.waiting and len(self.running) < self.config.scheduler.max_num_seqs:
            request = self.waiting[0]
            pages = self._pages_for(len(request.prompt) + request.sampling.max_tokens)
            if pages > free:
                break
            self.waiting.pop(0)
            request.pages, free = pages, free - pages
            self.running[request.request_id] = request

    def _advance(self, request: _FakeRequest) -> RequestOutput:
        last = request.output[-1] if request.output else request.prompt[-1]
        token = next_letter(last) if self.reply is None else ord(self.reply[len(request.output)])
        request.output.append(token)
        self._stats.generated_tokens_total += 1
        new_text = chr(token)
        finish_reason = stop_reason = None
        text = request.text + new_text
        for stop in request.sampling.stop:
            if stop in text:
                cut = text.index(stop)
                new_text = text[len(request.text):cut] if cut >= len(request.text) else ""
                text, finish_reason, stop_reason = text[:cut], "stop", stop
                break
        if finish_reason is None and len(request.output) >= request.sampling.max_tokens:
            finish_reason = "length"
        if finish_reason is None and self.reply is not None and len(request.output) == len(self.reply):
            finish_reason = "stop"  # as if EOS came next
        request.text = text
        logprobs = None
        if request.sampling.logprobs is not None:
            top = {next_letter(token + k - 1): -0.5 - k for k in range(request.sampling.logprobs)}
            logprobs = [TokenLogprob(token, -0.5, top)]
        if finish_reason is not None:
            del self.running[request.request_id]
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[token], new_text=new_text,
            output_token_ids=list(request.output), text=text, num_prompt_tokens=len(request.prompt),
            finished=finish_reason is not None, finish_reason=finish_reason, new_logprobs=logprobs,
            stop_reason=stop_reason)


CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chatml_tokenizer(template: str = CHATML_TEMPLATE) -> Tokenizer:
    """A byte-level tokenizer (ids 0..255 are bytes) with ChatML's control tokens: 256, 257."""
    alphabet = byte_to_unicode()
    backend = tokenizers.Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<|im_start|>", "<|im_end|>")])
    return Tokenizer(backend, chat_template=template, bos_token_id=256, eos_token_ids=(257,))


# ---- running an app -----------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def asgi_client(app, **client_kwargs) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client wired straight to `app`, with its lifespan (the engine thread) running.

    httpx's ASGI transport buffers whole responses: use live_server() for streaming timing and
    real disconnects.
    """
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     **client_kwargs) as client:
            yield client


def live_server(app, *, graceful_seconds: float = 5.0, limits: HTTPLimits = HTTPLimits(),
                **uvicorn_config) -> contextlib.AbstractContextManager[ServedApp]:
    """Serve `app` with uvicorn on a free loopback port, in a background thread (.url, .server, .thread),
    with serve's HTTP limits; `uvicorn_config`: more uvicorn.Config options (root_path, ...)."""
    return served_in_thread(app, timeout_graceful_shutdown=graceful_seconds, backlog=2048,
                            **limits.uvicorn_options(), **uvicorn_config)


def parse_sse(text: str) -> list[dict | str]:
    """The data payloads of an SSE body: dicts for JSON events, the string "[DONE]" as is."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def wait_until(predicate, timeout: float = 60.0, interval: float = 0.01) -> None:
    """Polls `predicate` (a test helper; the server itself never polls). The timeout only bounds a
    hang: it returns as soon as the predicate holds, and a busy host may take seconds to get there."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)
