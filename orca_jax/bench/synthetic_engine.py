"""An engine stand-in with no model, for timing what the HTTP server costs around an engine.

It keeps the Engine contract the server uses (add_request, abort, step, has_unfinished, stats) and
generates one letter per running request per step, so every token costs the server what a real one
does. A step can hold the GIL for `host_seconds` of thread CPU (the real engine's scheduling, batch
building and output handling) and then release it for `device_seconds` (waiting on the GPU): the
host part is what event-loop work on other threads slows down, as it does in the real server.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from orca_jax.config import CacheConfig, EngineConfig, ModelConfig, ModelFamily, SchedulerConfig
from orca_jax.engine import EngineStats
from orca_jax.outputs import RequestOutput
from orca_jax.request import SamplingParams
from orca_jax.tokenizer import ByteTokenizer

FIRST_LETTER, NUM_LETTERS = ord("a"), 26
EOS = 2


@dataclasses.dataclass(slots=True)
class _Running:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    text: str = ""


class SyntheticEngine:
    """Engine stand-in: each step gives every running request its next letter (a..z, wrapping)."""

    def __init__(self, *, max_num_seqs: int = 128, max_waiting: int = 4096, max_model_len: int = 2048,
                 host_seconds: float = 0.0, device_seconds: float = 0.0):
        self.config = EngineConfig(
            model="synthetic", cache=CacheConfig(page_size=16, num_pages=1 << 16),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                      max_num_batched_tokens=max(2048, max_num_seqs)))
        self.tokenizer = ByteTokenizer(eos_token_ids=(EOS,), bos_token_id=1)
        self.model_config = ModelConfig(
            family=ModelFamily.LLAMA, vocab_size=self.tokenizer.vocab_size, hidden_size=8, num_layers=1,
            num_heads=1, num_kv_heads=1, head_dim=8, ffn_size=8, max_seq_len=max_model_len,
            eos_token_ids=(EOS,))
        self.max_model_len = max_model_len
        self.host_seconds = host_seconds
        self.device_seconds = device_seconds
        self.step_thread_ident: int | None = None  # the thread that calls step(), for its CPU clock
        self._waiting: list[_Running] = []
        self._running: dict[str, _Running] = {}
        self._stats = EngineStats(kv_pages_total=1 << 16)
        self._arrivals = 0

    lora = None  # no LoRA adapters
    fine_tuning = None  # no fine-tuning jobs

    def list_loras(self) -> list:
        return []

    def add_request(self, prompt: list[int], sampling: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, deadline: float | None = None, lora_request=None) -> str:
        if lora_request is not None:
            raise ValueError("the synthetic engine serves no LoRA adapters")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens > max_model_len ({self.max_model_len})")
        request_id = request_id or f"synthetic-{self._arrivals}"
        self._arrivals += 1
        self._waiting.append(_Running(request_id, len(prompt), sampling.max_tokens))
        self._stats.prompt_tokens_total += len(prompt)
        return request_id

    def abort(self, request_id: str) -> bool:
        if self._running.pop(request_id, None) is not None:
            return True
        before = len(self._waiting)
        self._waiting = [r for r in self._waiting if r.request_id != request_id]
        return len(self._waiting) < before

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def has_work(self) -> bool:
        return self.has_unfinished()

    def step(self) -> list[RequestOutput]:
        self.step_thread_ident = threading.get_ident()
        room = self.config.scheduler.max_num_seqs - len(self._running)
        for request in self._waiting[:room]:
            self._running[request.request_id] = request
        del self._waiting[:room]
        if not self._running:
            return []
        start = time.perf_counter()
        _hold_gil_for(self.host_seconds)
        if self.device_seconds:
            time.sleep(self.device_seconds)  # releases the GIL, as waiting on the device does
        outputs = [self._advance(r) for r in list(self._running.values())]
        stats = self._stats
        stats.iterations += 1
        stats.last_batch_size = stats.last_num_tokens = len(outputs)
        stats.last_iteration_seconds = time.perf_counter() - start
        return outputs

    def stats(self) -> EngineStats:
        stats = dataclasses.replace(self._stats)
        stats.num_running = len(self._running)
        stats.num_waiting = len(self._waiting)
        return stats

    def _advance(self, request: _Running) -> RequestOutput:
        last = request.output[-1] if request.output else FIRST_LETTER - 1
        token = FIRST_LETTER + (last - FIRST_LETTER + 1) % NUM_LETTERS
        request.output.append(token)
        request.text += chr(token)
        self._stats.generated_tokens_total += 1
        finished = len(request.output) >= request.max_tokens
        if finished:
            del self._running[request.request_id]
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[token], new_text=chr(token),
            output_token_ids=list(request.output), text=request.text,
            num_prompt_tokens=request.num_prompt_tokens, finished=finished,
            finish_reason="length" if finished else None, queue_seconds=0.0)


def _hold_gil_for(cpu_seconds: float) -> None:
    # Thread CPU time, not wall time: while another thread holds the GIL this one makes no progress,
    # so the work takes longer, just as the real engine's host work does.
    if cpu_seconds <= 0:
        return
    start = time.thread_time()
    while time.thread_time() - start < cpu_seconds:
        pass
