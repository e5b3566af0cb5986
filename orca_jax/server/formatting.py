"""RequestOutputs -> OpenAI response bodies and streaming chunks (JSON strings).

One formatter serves one HTTP response, which may hold several choices (n > 1, or several
prompts): every method takes the choice's index, and per-choice state is kept by index.
"""

from __future__ import annotations

import json

from orca_jax.outputs import RequestOutput, TokenLogprob
from orca_jax.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
    TopLogprob, Usage,
)

# JSON has no -inf; OpenAI clients expect a number, so a vanishing probability becomes this.
MIN_LOGPROB = -9999.0

# A finished choice: its last output and all of its logprobs (None when none were asked for).
Final = tuple[RequestOutput, list[TokenLogprob] | None]


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _json(value: str | None) -> str:
    # ensure_ascii=False writes text as pydantic does (UTF-8, not \u escapes).
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


class _ChunkFrame:
    """A streamed chunk's JSON with a hole where its one choice goes; built once per response.

    Each token of each stream is one chunk. Building and serializing pydantic models for it took
    more of the event loop than anything else we control, and that loop shares the GIL with the
    engine thread; the per-token choices are now written as strings into this frame instead.
    test_server_formatting checks that the result equals the models' JSON byte for byte.
    """

    def __init__(self, chunk_without_choices_json: str):
        head, hole, tail = chunk_without_choices_json.partition('"choices":[]')
        if not hole:
            raise ValueError(f"no empty choices list in {chunk_without_choices_json!r}")
        self.head = head + '"choices":['
        self.tail = "]" + tail

    def around(self, choice_json: str) -> str:
        return self.head + choice_json + self.tail


class _Formatter:
    """What both endpoints' formatters share: identity of the response and the tokenizer."""

    def __init__(self, response_id: str, model: str, created: int, tokenizer, *, include_usage: bool):
        self.response_id = response_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.include_usage = include_usage

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class CompletionFormatter(_Formatter):
    """Bodies of /v1/completions (object "text_completion", streamed or not)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # choice -> where its next token's text starts
        self._frame = _ChunkFrame(self._response([], usage=None).model_dump_json())

    def logprobs(self, index: int, items: list[TokenLogprob]) -> CompletionLogprobs:
        result = CompletionLogprobs()
        offset = self._text_offsets.get(index, 0)
        for item in items:
            token = self.token_text(item.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(_clamp(item.logprob))
            result.top_logprobs.append({self.token_text(t): _clamp(lp) for t, lp in item.top.items()})
            result.text_offset.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return result

    def opening_chunks(self, num_choices: int) -> list[str]:
        return []

    def chunks(self, index: int, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.finished or output.new_logprobs):
            return []  # text held back (a stop string may be forming): nothing to say yet
        finish_reason = output.finish_reason if output.finished else None
        if output.new_logprobs is None:  # the common case, written by hand: see _ChunkFrame
            return [self._frame.around(f'{{"index":{index},"text":{_json(output.new_text)},'
                                       f'"logprobs":null,"finish_reason":{_json(finish_reason)}}}')]
        choice = CompletionChoice(index=index, text=output.new_text, finish_reason=finish_reason,
                                  logprobs=self.logprobs(index, output.new_logprobs))
        return [self._frame.around(choice.model_dump_json())]

    def usage_chunk(self, usage: Usage) -> str:
        return self._response([], usage=usage).model_dump_json()

    def response(self, finals: list[Final], usage: Usage) -> CompletionResponse:
        choices = [CompletionChoice(index=index, text=final.text, finish_reason=final.finish_reason,
                                    logprobs=self.logprobs(index, logprobs) if logprobs is not None else None)
                   for index, (final, logprobs) in enumerate(finals)]
        return self._response(choices, usage=usage)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)


class ChatFormatter(_Formatter):
    """Bodies of /v1/chat/completions ("chat.completion" and "chat.completion.chunk")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._frame = _ChunkFrame(ChatCompletionChunk(id=self.response_id, created=self.created,
                                                      model=self.model, choices=[]).model_dump_json())

    def logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top(item.token_id, item.logprob).model_dump(),
                             top_logprobs=[self._top(t, lp) for t, lp in
                                           sorted(item.top.items(), key=lambda kv: -kv[1])])
            for item in items])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode("utf-8")))

    def opening_chunks(self, num_choices: int) -> list[str]:
        # OpenAI's first chunk of each choice names the role and carries empty content.
        return [self._chunk(index, ChatDelta(role="assistant", content=""), None, None)
                for index in range(num_choices)]

    def chunks(self, index: int, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.finished or output.new_logprobs):
            return []
        finish_reason = output.finish_reason if output.finished else None
        if output.new_logprobs is None:  # the common case, written by hand: see _ChunkFrame
            delta = f'{{"content":{_json(output.new_text)}}}' if output.new_text else "{}"
            return [self._frame.around(f'{{"index":{index},"delta":{delta},"logprobs":null,'
                                       f'"finish_reason":{_json(finish_reason)}}}')]
        delta = ChatDelta(content=output.new_text) if output.new_text else ChatDelta()
        return [self._chunk(index, delta, self.logprobs(output.new_logprobs), finish_reason)]

    def usage_chunk(self, usage: Usage) -> str:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=[], usage=usage).model_dump_json()

    def response(self, finals: list[Final], usage: Usage) -> ChatCompletionResponse:
        choices = [ChatChoice(index=index, message=AssistantMessage(content=final.text),
                              finish_reason=final.finish_reason,
                              logprobs=self.logprobs(logprobs) if logprobs is not None else None)
                   for index, (final, logprobs) in enumerate(finals)]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage)

    def _chunk(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None,
               finish_reason: str | None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return self._frame.around(choice.model_dump_json())
