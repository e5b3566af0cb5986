"""Several engine requests behind one HTTP response (n > 1, a list of prompts).

Each choice is a plain engine request of its own (no KV shared between them): submitted together,
streamed as one merged sequence of (choice index, output), aborted together when the client leaves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request

from orca_jax.lora.request import LoRARequest
from orca_jax.outputs import PromptLogprobs, RequestOutput, TokenLogprob
from orca_jax.sampling_params import SamplingParams
from orca_jax.server.async_engine import RequestStream
from orca_jax.server.engine_client import EngineClient
from orca_jax.server.formatting import Final
from orca_jax.server.metrics import RequestTimer
from orca_jax.server.responses import Usage

if TYPE_CHECKING:
    from orca_jax.structured.matcher import CompiledGrammar


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """One engine request of a response."""

    index: int  # the choice's index in the response: prompt_index * n + its number among the n
    prompt_index: int
    prompt_ids: list[int]
    sampling: SamplingParams


def derive_seed(seed: int | None, number: int) -> int | None:
    """The seed of a prompt's `number`-th choice: the request's own for the first, distinct after.

    The first keeps the seed, so choice 0 of an n=3 request equals the n=1 answer. The others hash
    (seed, number) rather than add, so seed 7's second choice is not seed 8's first.
    """
    if seed is None or number == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{number}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def usage_of(choices: list[Choice], finals: list[RequestOutput | None]) -> Usage:
    """OpenAI's count: each prompt's tokens once, however many choices it has; every choice's output.
    A prompt's cached tokens are its first choice's (the others share what that one computed)."""
    prompt_tokens = {choice.prompt_index: len(choice.prompt_ids) for choice in choices}
    completion_tokens = sum(len(final.output_token_ids) for final in finals if final is not None)
    cached = {}
    for choice, final in zip(choices, finals):
        if final is not None:
            cached.setdefault(choice.prompt_index, final.num_cached_tokens)
    return Usage.of(sum(prompt_tokens.values()), completion_tokens, sum(cached.values()))


async def submit_all(async_engine: EngineClient, choices: list[Choice], *, request_id: str, priority: int,
                     deadline: float | None, lora_request: LoRARequest | None = None,
                     grammar: CompiledGrammar | None = None) -> list[RequestStream]:
    """Submit every choice; all or nothing (the first error is raised after the others are aborted).
    `grammar`: their structured_outputs, compiled (each choice gets its own matcher of it)."""

    def engine_id(choice: Choice) -> str:
        return request_id if len(choices) == 1 else f"{request_id}-{choice.index}"

    results = await asyncio.gather(*(
        async_engine.submit(choice.prompt_ids, choice.sampling, request_id=engine_id(choice),
                            priority=priority, deadline=deadline, lora_request=lora_request, grammar=grammar)
        for choice in choices), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for result in results:
            if isinstance(result, RequestStream):
                result.abort()
        raise errors[0]
    return results


class ChoiceStreams:
    """The running engine requests of one response, each with its latency timer."""

    def __init__(self, streams: list[RequestStream], timers: list[RequestTimer]):
        self.streams = streams
        self.timers = timers

    def abort_all(self) -> None:
        """No-op for finished choices; the others stop and count as aborted."""
        for stream, timer in zip(self.streams, self.timers):
            stream.abort()
            timer.on_abort()

    async def merged(self) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
        """(choice index, its outputs delivered by then) as they come, across all choices; ends when
        all have finished. Batches, not single outputs: see RequestStream.next_outputs."""
        if len(self.streams) == 1:  # the common case needs no pumping
            stream, timer = self.streams[0], self.timers[0]
            while outputs := await stream.next_outputs():
                timer.on_outputs(outputs)
                yield 0, outputs
            return
        queue: asyncio.Queue[tuple[int, list[RequestOutput] | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                while outputs := await stream.next_outputs():
                    queue.put_nowait((index, outputs))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, error))
            queue.put_nowait((index, None))

        tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self.timers[index].on_outputs(item)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, request: Request) -> list[Final] | None:
        """Every choice's final output and logprobs, or None when the client left first."""
        watcher = _abort_on_disconnect(request, self)
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        logprobs: list[list[TokenLogprob] | None] = [None] * len(self.streams)
        prompt_logprobs: list[PromptLogprobs | None] = [None] * len(self.streams)  # on each first output
        try:
            async for index, outputs in self.merged():
                for output in outputs:
                    if output.new_logprobs is not None:
                        logprobs[index] = logprobs[index] or []
                        logprobs[index].extend(output.new_logprobs)
                    if output.prompt_logprobs is not None:
                        prompt_logprobs[index] = output.prompt_logprobs
                    finals[index] = output
        finally:
            watcher.cancel()
            self.abort_all()  # no-op once finished; frees the KV when we were cancelled
        if any(final is None or not final.finished for final in finals):
            return None
        # The final output answers for the whole request, its prompt logprobs included.
        finals = [final if prompt is None else dataclasses.replace(final, prompt_logprobs=prompt)
                  for final, prompt in zip(finals, prompt_logprobs)]
        return list(zip(finals, logprobs))


def _abort_on_disconnect(request: Request, streams: ChoiceStreams) -> asyncio.Task:
    """A task that aborts every stream once the client disconnects (no polling: receive() blocks)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                streams.abort_all()
                return

    return asyncio.get_running_loop().create_task(watch())
