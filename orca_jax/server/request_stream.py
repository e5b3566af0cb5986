"""One request's outputs on the event loop: the engine thread delivers into it (put, via
loop.call_soon_threadsafe), a handler reads it as an async iterator or in batches."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from orca_jax.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, as an async iterator or in batches; the engine thread feeds it."""

    def __init__(self, request_id: str, num_prompt_tokens: int, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str], None]):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.loop = loop
        self.finished = False
        self._abort = abort
        # None ends the stream (abort). A deque and one waiter rather than an asyncio.Queue, whose
        # bookkeeping (task counts, putters) is paid per token on the event loop.
        self._pending: collections.deque[RequestOutput | BaseException | None] = collections.deque()
        self._num_ends = 0  # pending items that are not outputs (None, errors): taken one at a time
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException | None) -> None:
        """Event-loop side of a delivery from the engine thread."""
        if type(item) is not RequestOutput:
            self._num_ends += 1
        self._pending.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def abort(self) -> None:
        """Stop this request (client gone); the engine frees its KV before its next iteration."""
        if self.finished:
            return
        self.finished = True
        self._abort(self.request_id)
        self.put(None)  # wakes a consumer blocked in __anext__

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished and not self._pending:
            raise StopAsyncIteration
        await self._wait_for_delivery()
        output = self._take()
        if output is None:
            raise StopAsyncIteration
        return output

    async def next_outputs(self) -> list[RequestOutput]:
        """Every output delivered by now, in order (waiting for the first); [] once the stream ended.

        A handler that fell behind the engine gets all it missed at once and can send it in one
        write, so it catches up instead of paying a wake-up and a send per token.
        """
        if self.finished and not self._pending:
            return []
        await self._wait_for_delivery()
        if not self._num_ends:  # outputs only (almost always): all at once
            outputs = list(self._pending)
            self._pending.clear()
            if outputs[-1].finished:
                self.finished = True
            return outputs
        outputs = []
        while self._pending and not (outputs and isinstance(self._pending[0], BaseException)):
            output = self._take()  # raises a delivered error that comes first
            if output is None:
                break
            outputs.append(output)
        return outputs

    async def _wait_for_delivery(self) -> None:
        while not self._pending:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _take(self) -> RequestOutput | None:
        """The next delivery: an output, None at the end (abort), or its error raised."""
        item = self._pending.popleft()
        if type(item) is not RequestOutput:
            self._num_ends -= 1
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is not None and item.finished:
            self.finished = True
        return item
