"""RequestOutputs -> OpenAI response bodies and streaming chunks (JSON strings)."""

from __future__ import annotations

from orca_jax.outputs import RequestOutput, TokenLogprob
from orca_jax.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs, CompletionResponse,
    TopLogprob, Usage,
)

# JSON has no -inf; OpenAI clients expect a number, so a vanishing probability becomes this.
MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def usage_of(output: RequestOutput) -> Usage:
    return Usage.of(output.num_prompt_tokens, len(output.output_token_ids))


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
        self._text_offset = 0  # where the next token's text starts, for logprobs.text_offset

    def logprobs(self, items: list[TokenLogprob]) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for item in items:
            token = self.token_text(item.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(_clamp(item.logprob))
            result.top_logprobs.append({self.token_text(t): _clamp(lp) for t, lp in item.top.items()})
            result.text_offset.append(self._text_offset)
            self._text_offset += len(token)
        return result

    def opening_chunks(self) -> list[str]:
        return []

    def chunks(self, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.finished or output.new_logprobs):
            return []  # text held back (a stop string may be forming): nothing to say yet
        logprobs = self.logprobs(output.new_logprobs) if output.new_logprobs is not None else None
        choice = CompletionChoice(text=output.new_text, logprobs=logprobs,
                                  finish_reason=output.finish_reason if output.finished else None)
        return [self._response([choice], usage=None).model_dump_json()]

    def usage_chunk(self, final: RequestOutput) -> str:
        return self._response([], usage=usage_of(final)).model_dump_json()

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob] | None) -> CompletionResponse:
        choice = CompletionChoice(text=final.text, finish_reason=final.finish_reason,
                                  logprobs=self.logprobs(logprobs) if logprobs is not None else None)
        return self._response([choice], usage=usage_of(final))

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)


class ChatFormatter(_Formatter):
    """Bodies of /v1/chat/completions ("chat.completion" and "chat.completion.chunk")."""

    def logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top(item.token_id, item.logprob).model_dump(),
                             top_logprobs=[self._top(t, lp) for t, lp in
                                           sorted(item.top.items(), key=lambda kv: -kv[1])])
            for item in items])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode("utf-8")))

    def opening_chunks(self) -> list[str]:
        # OpenAI's first chunk names the role and carries empty content.
        return [self._chunk(ChatDelta(role="assistant", content=""), None, None)]

    def chunks(self, output: RequestOutput) -> list[str]:
        if not (output.new_text or output.finished or output.new_logprobs):
            return []
        logprobs = self.logprobs(output.new_logprobs) if output.new_logprobs is not None else None
        delta = ChatDelta(content=output.new_text) if output.new_text else ChatDelta()
        return [self._chunk(delta, logprobs, output.finish_reason if output.finished else None)]

    def usage_chunk(self, final: RequestOutput) -> str:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=[], usage=usage_of(final)).model_dump_json()

    def response(self, final: RequestOutput, logprobs: list[TokenLogprob] | None) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=final.text), finish_reason=final.finish_reason,
                            logprobs=self.logprobs(logprobs) if logprobs is not None else None)
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage_of(final))

    def _chunk(self, delta: ChatDelta, logprobs: ChatLogprobs | None, finish_reason: str | None) -> str:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=[choice]).model_dump_json()
