"""RequestOutputs -> OpenAI response bodies and streaming chunks (JSON strings).

One formatter serves one HTTP response, which may hold several choices (n > 1, or several
prompts): every method takes the choice's index, and per-choice state is kept by index. A chat
request with tools reads its tool calls out of each choice's text with the plan's parser; a stream
feeds it each delta, so calls go out as `delta.tool_calls` once their JSON is complete.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # json.dumps(text, ensure_ascii=False) without its encoder object

import orjson

from orca_jax.outputs import PromptLogprobs, RequestOutput, TokenLogprob
from orca_jax.server import responses
from orca_jax.server.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    ChatDelta, ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionResponse,
    DeltaFunctionCall, DeltaToolCall, FunctionCall, PromptLogprob, ToolCall, Usage,
)
from orca_jax.server.structured import ToolPlan
from orca_jax.structured.tool_parsers import ParsedDelta, StreamingToolParser, ToolCallDelta

# JSON has no -inf; OpenAI clients expect a number, so a vanishing probability becomes this.
MIN_LOGPROB = -9999.0

# A finished choice: its last output (with the request's prompt_logprobs, when asked for) and all of
# its logprobs (None when none were asked for).
Final = tuple[RequestOutput, list[TokenLogprob] | None]


def _clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _json(value: str | int | None) -> str:
    # ensure_ascii=False writes text as pydantic does (UTF-8, not \u escapes).
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def cut_short(finish_reason: str | None) -> bool:
    """Whether a choice's text ended before the model ended it (max_tokens, an abort, a deadline): its
    tool-call parser then withholds the markup the cut left unfinished."""
    return finish_reason not in (None, "stop")


def _ends(output: RequestOutput) -> tuple[str | None, str | int | None]:
    """(finish_reason, stop_reason) of a chunk: both None until the output has finished."""
    return (output.finish_reason, output.stop_reason) if output.finished else (None, None)


class _ChunkFrame:
    """A streamed chunk's JSON with a hole where its one choice goes; built once per response.

    Each token of each stream is one chunk. Building and serializing pydantic models for it took
    more of the event loop than anything else we control, and that loop shares the GIL with the
    engine thread; the per-token choices are now written as strings into this frame instead, and a
    chunk of text that finishes nothing (almost every one) is two strings kept per choice around the
    text's JSON. tests/server/test_formatting.py checks that the result equals the models' JSON byte
    for byte.
    """

    def __init__(self, chunk_without_choices_json: str, text_choice: str):
        head, hole, tail = chunk_without_choices_json.partition('"choices":[]')
        if not hole:
            raise ValueError(f"no empty choices list in {chunk_without_choices_json!r}")
        self.head = head + '"choices":['
        self.tail = "]" + tail
        # The choice of a text chunk, {index} and {text} its holes: split once per choice, on first use.
        self._text_choice = text_choice
        self._around_text: dict[int, tuple[str, str]] = {}

    def around(self, choice_json: str) -> str:
        return self.head + choice_json + self.tail

    def text_chunk(self, index: int, text: str) -> str:
        """The chunk of choice `index` carrying `text` and finishing nothing."""
        around = self._around_text.get(index)
        if around is None:
            before, _, after = self._text_choice.replace("{index}", str(index)).partition("{text}")
            around = self._around_text[index] = (self.head + before, after + self.tail)
        return around[0] + encode_basestring(text) + around[1]


class _Formatter:
    """What both endpoints' formatters share: identity of the response and the tokenizer.

    `prompt_logprobs`: the top k each prompt position shows in the prompt_logprobs field (the
    request's own; the engine may have computed more for an echo), None when not asked for.
    """

    def __init__(self, response_id: str, model: str, created: int, tokenizer, *, include_usage: bool,
                 prompt_logprobs: int | None = None):
        self.response_id = response_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.num_prompt_logprobs = prompt_logprobs
        # Logprobs name the same few tokens over and over (n=64 x 128 tokens x 20 top: 170,000 names of
        # at most a vocabulary's worth): each is decoded once per response.
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def response_body(self, finals: list[Final], usage: Usage) -> bytes:
        """The non-streamed response as JSON (UTF-8): what response() says, encoded by pydantic's
        serializer (5x json.dumps on a 10 MB body), one choice at a time (_framed). Run it off the
        event loop: it is proportional to n x max_tokens x top_logprobs."""
        response = self.response(finals, usage)
        return _framed(response.model_copy(update={"choices": []}).model_dump_json().encode(),
                       [choice.model_dump_json().encode() for choice in response.choices])

    def prompt_logprobs(self, positions: PromptLogprobs | None) -> responses.PromptLogprobs | None:
        """vLLM's prompt_logprobs field: at each position the prompt token (first) and the top k."""
        if self.num_prompt_logprobs is None or positions is None:
            return None
        return [None if position is None else {
            str(token): PromptLogprob(logprob=_clamp(item.logprob), rank=item.rank, decoded_token=self.token_text(token))
            for j, (token, item) in enumerate(position.items()) if j == 0 or item.rank <= self.num_prompt_logprobs}
            for position in positions]


class CompletionFormatter(_Formatter):
    """Bodies of /v1/completions (object "text_completion", streamed or not).

    `echo_texts` (echo: true): each choice's prompt text, put before its completion. `echo_logprobs`
    (echo with logprobs: k): the top k of each prompt token go before the completion's logprobs, read
    from the request's prompt logprobs; `prompt_ids` are then each choice's prompt.
    """

    def __init__(self, *args, echo_texts: list[str] | None = None, echo_logprobs: int | None = None,
                 prompt_ids: list[list[int]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # choice -> where its next token's text starts
        self._frame = _ChunkFrame(self._response([], usage=None).model_dump_json(),
                                  '{"index":{index},"text":{text},"logprobs":null,"finish_reason":null,"stop_reason":null}')
        self._echo_texts = echo_texts
        self._unechoed = set(range(len(echo_texts))) if echo_texts else set()  # streamed choices yet to echo
        self._echo_logprobs = echo_logprobs
        self._prompt_ids = prompt_ids

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

    def _with_echo(self, index: int, output: RequestOutput, items: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        """The choice's logprobs, the echoed prompt's first when it carries them (OpenAI's legacy
        completions: the first prompt token's logprob and top are null)."""
        if self._echo_logprobs is None or output.prompt_logprobs is None:
            return None if items is None else self.logprobs(index, items)
        result = CompletionLogprobs()
        offset = 0
        for token, position in zip(self._prompt_ids[index], output.prompt_logprobs):
            text = self.token_text(token)
            result.tokens.append(text)
            result.token_logprobs.append(None if position is None else _clamp(position[token].logprob))
            result.top_logprobs.append(None if position is None else {
                self.token_text(t): _clamp(item.logprob) for t, item in position.items()
                if item.rank <= self._echo_logprobs})
            result.text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        if items:
            generated = self.logprobs(index, items)
            for name in CompletionLogprobs.model_fields:
                getattr(result, name).extend(getattr(generated, name))
        return result

    def opening_chunks(self, num_choices: int) -> list[str]:
        return []

    def chunks(self, index: int, output: RequestOutput) -> list[str]:
        text = output.new_text
        logprobs = output.new_logprobs
        echoing = index in self._unechoed
        if echoing:
            self._unechoed.discard(index)
            text = self._echo_texts[index] + text
        if not (text or output.finished or logprobs):
            return []  # text held back (a stop string may be forming): nothing to say yet
        if not output.finished and logprobs is None and not echoing:
            return [self._frame.text_chunk(index, text)]
        finish_reason, stop_reason = _ends(output)
        if logprobs is None and not (echoing and self._echo_logprobs is not None):
            # the common case, written by hand: see _ChunkFrame
            return [self._frame.around(f'{{"index":{index},"text":{_json(text)},"logprobs":null,'
                                       f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}')]
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
                                  logprobs=self._with_echo(index, output, logprobs) if echoing
                                  else self.logprobs(index, logprobs))
        return [self._frame.around(choice.model_dump_json())]

    def usage_chunk(self, usage: Usage) -> str:
        return self._response([], usage=usage).model_dump_json()

    def response(self, finals: list[Final], usage: Usage) -> CompletionResponse:
        choices = [CompletionChoice(index=index, text=(self._echo_texts[index] if self._echo_texts else "") + final.text,
                                    finish_reason=final.finish_reason, stop_reason=final.stop_reason,
                                    logprobs=self._with_echo(index, final, logprobs),
                                    prompt_logprobs=self.prompt_logprobs(final.prompt_logprobs))
                   for index, (final, logprobs) in enumerate(finals)]
        return self._response(choices, usage=usage)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)


class ChatFormatter(_Formatter):
    """Bodies of /v1/chat/completions ("chat.completion" and "chat.completion.chunk").

    `tools` (a chat with tools): how tool calls are read out of each choice's text.
    """

    def __init__(self, *args, tools: ToolPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._frame = _ChunkFrame(ChatCompletionChunk(id=self.response_id, created=self.created,
                                                      model=self.model, choices=[]).model_dump_json(),
                                  '{"index":{index},"delta":{"content":{text}},"logprobs":null,"finish_reason":null,'
                                  '"stop_reason":null}')
        self._tools = tools
        self._parsers: dict[int, StreamingToolParser] = {}  # streamed choice -> its tool-call parser
        self._num_calls: dict[int, int] = {}  # streamed choice -> calls sent so far
        self._token_bytes: dict[int, list[int]] = {}

    def logprobs(self, items: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs.model_validate({"content": self.logprob_content(items)})

    def logprob_content(self, items: list[TokenLogprob]) -> list[dict]:
        """ChatLogprobs' content as plain JSON values (what ChatLogprobs dumps); a non-streamed body
        of 170,000 of them is built as these, not as models (~10x faster)."""
        return [{**self._top(item.token_id, item.logprob),
                 "top_logprobs": [self._top(t, lp) for t, lp in sorted(item.top.items(), key=lambda kv: -kv[1])]}
                for item in items]

    def _top(self, token_id: int, logprob: float) -> dict:
        """A TopLogprob's fields (the bytes list is shared by every entry of the token: read only)."""
        token = self.token_text(token_id)
        spelt = self._token_bytes.get(token_id)
        if spelt is None:
            spelt = self._token_bytes[token_id] = list(token.encode("utf-8"))
        return {"token": token, "logprob": _clamp(logprob), "bytes": spelt}

    def opening_chunks(self, num_choices: int) -> list[str]:
        # OpenAI's first chunk of each choice names the role and carries empty content.
        return [self._chunk(index, ChatDelta(role="assistant", content=""), None, None)
                for index in range(num_choices)]

    def chunks(self, index: int, output: RequestOutput) -> list[str]:
        if self._tools is not None:
            return self._tool_chunks(index, output)
        if not (output.new_text or output.finished or output.new_logprobs):
            return []
        if not output.finished and output.new_logprobs is None:  # text, and nothing else: see _ChunkFrame
            return [self._frame.text_chunk(index, output.new_text)]
        finish_reason, stop_reason = _ends(output)
        if output.new_logprobs is None:  # the common case, written by hand: see _ChunkFrame
            delta = f'{{"content":{_json(output.new_text)}}}' if output.new_text else "{}"
            return [self._frame.around(f'{{"index":{index},"delta":{delta},"logprobs":null,'
                                       f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}')]
        delta = ChatDelta(content=output.new_text) if output.new_text else ChatDelta()
        return [self._chunk(index, delta, self.logprobs(output.new_logprobs), finish_reason, stop_reason)]

    def _tool_chunks(self, index: int, output: RequestOutput) -> list[str]:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._tools.parser.streaming()
        parsed = parser.feed(output.new_text)
        if output.finished:
            last = parser.finish(truncated=cut_short(output.finish_reason))
            parsed = ParsedDelta(parsed.content + last.content, parsed.tool_calls + last.tool_calls)
        calls = _delta_tool_calls(parsed.tool_calls)
        self._num_calls[index] = self._num_calls.get(index, 0) + sum(call.id is not None for call in calls)
        if not (parsed.content or calls or output.finished or output.new_logprobs):
            return []
        finish_reason, stop_reason = _ends(output)
        if output.finished:
            finish_reason = self._tools.finish_reason(finish_reason, self._num_calls[index])
        delta = ChatDelta(content=parsed.content or None, tool_calls=calls or None)
        logprobs = self.logprobs(output.new_logprobs) if output.new_logprobs is not None else None
        return [self._chunk(index, delta, logprobs, finish_reason, stop_reason)]

    def usage_chunk(self, usage: Usage) -> str:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=[], usage=usage).model_dump_json()

    def response(self, finals: list[Final], usage: Usage) -> ChatCompletionResponse:
        choices = []
        for index, (final, logprobs) in enumerate(finals):
            message, finish_reason = AssistantMessage(content=final.text), final.finish_reason
            if self._tools is not None:
                content, calls = self._tools.parser.parse(final.text, truncated=cut_short(final.finish_reason))
                message = AssistantMessage(content=content, tool_calls=[
                    ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                    for call in calls] or None)
                finish_reason = self._tools.finish_reason(finish_reason, len(calls))
            choices.append(ChatChoice(index=index, message=message, finish_reason=finish_reason,
                                      stop_reason=final.stop_reason,
                                      logprobs=self.logprobs(logprobs) if logprobs is not None else None))
        # One prompt for every choice: the first's prompt logprobs are all of theirs (vLLM's field).
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage,
                                      prompt_logprobs=self.prompt_logprobs(finals[0][0].prompt_logprobs))

    def response_body(self, finals: list[Final], usage: Usage) -> bytes:
        """response()'s JSON, with each choice's logprobs written as plain values (logprob_content)
        into the models' dump of the rest, then encoded by orjson (15x json.dumps here), one choice
        at a time (_framed)."""
        response = self.response([(final, None) for final, _ in finals], usage)
        choices = []
        for choice, (_, items) in zip(response.choices, finals):
            body = choice.model_dump(mode="json")
            if items is not None:
                body["logprobs"] = {"content": self.logprob_content(items)}
            choices.append(orjson.dumps(body))
        return _framed(response.model_copy(update={"choices": []}).model_dump_json().encode(), choices)

    def _chunk(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None,
               finish_reason: str | None, stop_reason: str | int | None = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                 stop_reason=stop_reason)
        return self._frame.around(choice.model_dump_json())


def _framed(without_choices: bytes, choices: list[bytes]) -> bytes:
    """A response's JSON with no choices, and its choices' JSON, as one body. Each choice is encoded
    by a call of its own: one call for a whole 10 MB body held the GIL (and so the event loop) ~0.1 s."""
    head, hole, tail = without_choices.partition(b'"choices":[]')
    if not hole:  # a quote inside a JSON string is escaped, so this key is the body's own
        raise ValueError("no empty choices list in the response")
    return b"".join([head, b'"choices":[', b",".join(choices), b"]", tail])


def _delta_tool_calls(pieces: tuple[ToolCallDelta, ...]) -> list[DeltaToolCall]:
    """A chunk's tool-call pieces, one entry per call: its id, type and name (when this chunk
    starts it) with the arguments that came with them."""
    calls: dict[int, DeltaToolCall] = {}
    for piece in pieces:
        call = calls.get(piece.index)
        if call is None:
            calls[piece.index] = DeltaToolCall(
                index=piece.index, id=piece.id, type="function" if piece.id is not None else None,
                function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
        else:
            call.function.arguments = (call.function.arguments or "") + piece.arguments
    return list(calls.values())
