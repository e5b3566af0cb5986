"""Tool calls out of a model's text, in the formats vLLM's `--tool-call-parser` names.

- hermes (Qwen2.5, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, with text around;
- llama3_json (Llama 3.1-3.3): a text that starts with `{` or holds `<|python_tag|>`, then JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional text.

Markers that are special tokens (`<|python_tag|>`, `[TOOL_CALLS]`) are only in the text when it was
detokenized with skip_special_tokens=False; the server does that for requests with tools.

`parse` is the streaming parser fed the whole text at once, and the streaming parser only emits what
no later text can change, so the deltas of any split of a text add up to `parse` of it.

hermes and llama3_json stream a call's arguments as they are generated, as vLLM does: once a call's
text reads `{"name": "N", "arguments": {` (llama3_json: "parameters" or "arguments") its index, id
and name go out, then the arguments object's text as it comes (the model's own text, whitespace
included), until the object closes; what follows it in the call object is skipped. Such a call
stays a call whatever follows: a text cut by max_tokens gives the arguments written so far (not
valid JSON then; finish_reason says "length"), and a hermes call whose name was complete but whose
arguments had not begun gives "". mistral's calls, and calls written otherwise (arguments first, or
as a JSON string), are emitted when their JSON is complete: index, id and name, then the arguments
as one fragment; such a call whose JSON does not parse, or does not name a function, stays in the
content as the text it was. Whitespace next to calls is layout and dropped; other content is kept
verbatim.

A text cut short (`finish(truncated=True)`: max_tokens, an abort) never ends in markup: the part of an
opener it ends in (`<tool_c`) and a call it cut before the call could be read (`<tool_call>{"na`,
mistral's list before its first complete call) are withheld, so a cut call comes back as a call or
not at all, never as content. A text the model ended itself keeps such pieces as content: there
they are what it wrote.
"""

from __future__ import annotations

import dataclasses
import secrets
import string
import types
import uuid
from typing import Callable

from orca_jax.structured.tool_json import (CALL_HEAD, CALL_NAME, JSON_CALL_HEAD, ValueEnd, as_call, call_of,
                                          complete_items, loads_or_none, may_begin_call, partial_suffix)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call, as OpenAI's `message.tool_calls[i]` carries it."""

    id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of `delta.tool_calls`: index, id and name in a call's first piece, then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedDelta:
    """What one text delta adds: content text and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's chat template requires ids of exactly 9 letters and digits."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class StreamingToolParser:
    """Feed text deltas in order, then call finish(); each returns what is now certain."""

    def __init__(self, id_factory: Callable[[], str]):
        self._id_factory = id_factory
        self._buf = ""  # text received and not yet decided
        self._content: list[str] = []  # output of the current feed
        self._calls: list[ToolCallDelta] = []
        self._num_calls = 0
        self._held_space = ""  # whitespace-only content kept back until we know what follows it
        self._after_call = False  # the content since the last call is all whitespace so far
        self._value_end = ValueEnd()  # scans the JSON at the start of the undecided text
        self._truncated = False  # the text was cut short (set by finish)

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._advance(final=False)
        return self._flush()

    def finish(self, truncated: bool = False) -> ParsedDelta:
        """The text ended: what is left. truncated: it was cut short (finish_reason "length"), so
        unfinished markup at its end is withheld rather than passed on as content."""
        self._truncated = truncated
        self._advance(final=True)
        if self._num_calls == 0:
            self._content.append(self._held_space)
        self._held_space = ""
        return self._flush()

    # --- for the formats ----------------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _emit_content(self, text: str) -> None:
        if self._after_call:  # whitespace after a call is layout too
            text = text.lstrip()
            self._after_call = not text
        if not text:
            return
        body = text.rstrip()
        if not body:
            self._held_space += text
            return
        self._content.append(self._held_space + body)
        self._held_space = text[len(body):]

    def _emit_call(self, name: str, arguments: str) -> None:
        self._emit_call_head(name)
        self._emit_arguments(arguments)

    def _emit_call_head(self, name: str) -> None:
        """A new call's index, id and name; its arguments follow in _emit_arguments."""
        self._held_space = ""  # whitespace before a call is layout, not content
        self._after_call = True
        self._num_calls += 1
        self._calls.append(ToolCallDelta(self._num_calls - 1, self._id_factory(), name))

    def _emit_arguments(self, text: str) -> None:
        """More of the last call's arguments text."""
        if text:
            self._calls.append(ToolCallDelta(self._num_calls - 1, arguments=text))

    def _take(self, count: int) -> str:
        taken, self._buf = self._buf[:count], self._buf[count:]
        self._value_end.reset()  # what it scanned has moved
        return taken

    def _take_scanned(self, count: int) -> str:
        """_take, keeping the scan of the value that the taken text begins (it goes on after it)."""
        taken, self._buf = self._buf[:count], self._buf[count:]
        self._value_end.drop(count)
        return taken

    def _content_until(self, marker: str, final: bool) -> bool:
        """Emit content up to `marker` and drop the marker: True when it was found. Otherwise emit
        all but a tail that could still begin the marker (all of it when final, unless the text was
        cut short: then that tail is a cut marker, and is dropped)."""
        at = self._buf.find(marker)
        if at >= 0:
            self._emit_content(self._take(at))
            self._take(len(marker))
            return True
        keep = 0 if final and not self._truncated else partial_suffix(self._buf, marker)
        self._emit_content(self._take(len(self._buf) - keep))
        if final:
            self._take(len(self._buf))
        return False

    def _flush(self) -> ParsedDelta:
        delta = ParsedDelta("".join(self._content), tuple(self._calls))
        self._content, self._calls = [], []
        return delta


class HermesParser(StreamingToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, id_factory: Callable[[], str] = openai_call_id):
        super().__init__(id_factory)
        self._in_call = False
        # A streamed call: "arguments" while its arguments object is open, "rest" after it closed
        # (what is left before END is layout); None: the call's head is not read yet.
        self._streaming: str | None = None

    def _advance(self, final: bool) -> None:
        while True:
            if not self._in_call:
                if not self._content_until(self.START, final):
                    return
                self._in_call = True
            if self._streaming is None and not self._start_streaming(final):
                if not self._whole_call(final):
                    return
            elif self._streaming == "arguments":
                if not self._stream_arguments(final):
                    return
            elif self._streaming == "rest":
                if not self._skip_rest(final):
                    return
            if not self._buf:
                return

    def _start_streaming(self, final: bool) -> bool:
        """Read the call's head `{"name": "N", "arguments": ` when its arguments are an object; True
        once the call is streaming. False: not yet known (more text may tell), or written otherwise."""
        head = CALL_HEAD.match(self._buf)
        end = self._buf.find(self.END)
        if head is not None and self._buf.startswith("{", head.end()) and (end < 0 or end > head.end()):
            name = loads_or_none(f'"{head.group(1)}"')
            if isinstance(name, str) and name:
                self._take(head.end())
                self._emit_call_head(name)
                self._streaming = "arguments"
                return True
        if final and end < 0:  # cut short after the name: a call whose arguments never began
            named = CALL_NAME.match(self._buf)
            name = loads_or_none(f'"{named.group(1)}"') if named is not None else None
            if isinstance(name, str) and name and as_call(self._buf, "arguments") is None:
                self._take(len(self._buf))
                self._emit_call_head(name)
                self._in_call = False
                return True
        return False

    def _whole_call(self, final: bool) -> bool:
        """A call read when its END (or the text's end) comes; False when that is still to come."""
        at = self._buf.find(self.END)
        if at < 0 and not final:
            return False
        body = self._take(at if at >= 0 else len(self._buf))
        closing = self._take(len(self.END)) if at >= 0 else ""
        call = as_call(body, "arguments")
        if call is None:
            if at >= 0 or not self._truncated:  # a call cut before it could be read is withheld
                self._emit_content(self.START + body + closing)
        else:
            self._emit_call(*call)
        self._in_call = False
        return True

    def _stream_arguments(self, final: bool) -> bool:
        """Emit the arguments object's text so far; True once it has closed (or the call ended)."""
        end = self._value_end(self._buf)
        stop = self._buf.find(self.END)
        if end is not None and (stop < 0 or end <= stop):
            self._emit_arguments(self._take(end))
            self._streaming = "rest"
            return True
        if stop >= 0:  # the call ended inside its arguments: they are what was written
            self._emit_arguments(self._take(stop))
            self._take(len(self.END))
            self._in_call, self._streaming = False, None
            return True
        keep = 0 if final and not self._truncated else partial_suffix(self._buf, self.END)
        self._emit_arguments(self._take_scanned(len(self._buf) - keep))
        if final:  # a cut closing tag is not arguments
            self._take(len(self._buf))
            self._in_call, self._streaming = False, None
        return final

    def _skip_rest(self, final: bool) -> bool:
        """Drop the call's closing `}` and layout up to END; True once END (or the text) ended."""
        at = self._buf.find(self.END)
        if at < 0 and not final:
            return False
        self._take(at + len(self.END) if at >= 0 else len(self._buf))
        self._in_call, self._streaming = False, None
        return True


class Llama3JsonParser(StreamingToolParser):
    TAG = "<|python_tag|>"

    def __init__(self, id_factory: Callable[[], str] = openai_call_id):
        super().__init__(id_factory)
        # start -> calls <-> separator (calls -> arguments -> call_end -> separator when a call streams);
        # or text; failed: all the rest is content
        self._state = "start"
        self._raw_tag = ""  # the tag or `;` before a call, put back into the content if the call fails

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith("{"):
                    # The leading whitespace goes back into the content if the first call fails.
                    self._raw_tag = self._take(len(self._buf) - len(stripped))
                    self._state = "calls"
                elif not final and (not stripped or self.TAG.startswith(stripped)):
                    return
                else:
                    self._state = "text"
            if self._state == "text":
                if not self._content_until(self.TAG, final):
                    return
                self._raw_tag, self._state = self.TAG, "calls"
            if self._state == "failed":
                self._emit_content(self._take(len(self._buf)))
                return
            if self._state == "calls":
                stripped = self._buf.lstrip()
                head = JSON_CALL_HEAD.match(stripped)
                name = loads_or_none(f'"{head.group(1)}"') if head and stripped.startswith("{", head.end()) else None
                if isinstance(name, str) and name:  # its arguments stream from here
                    self._take(len(self._buf) - len(stripped) + head.end())
                    self._emit_call_head(name)
                    self._raw_tag, self._state = "", "arguments"
                    continue
                end = self._value_end(stripped) if stripped.startswith("{") else None
                if end is None and not final and (not stripped or stripped.startswith("{")):
                    return
                skip = len(self._buf) - len(stripped)
                call = None if end is None else as_call(stripped[:end], "parameters", "arguments")
                if call is None:
                    rest = self._take(len(self._buf))
                    # Cut short after a tag or `;`, or inside what begins as a call: withheld.
                    if not (end is None and self._truncated and (self._raw_tag.strip() or may_begin_call(stripped))):
                        self._emit_content(self._raw_tag + rest)
                    self._state = "failed"
                    continue
                self._take(skip + end)
                self._emit_call(*call)
                self._raw_tag, self._state = "", "separator"
            if self._state == "arguments":
                end = self._value_end(self._buf)
                if end is None:  # all of it is arguments so far (the rest, when the text ends here)
                    self._emit_arguments(self._take_scanned(len(self._buf)))
                    return
                self._emit_arguments(self._take(end))
                self._value_end.reset(depth=1)  # inside the call object: find where it closes
                self._state = "call_end"
            if self._state == "call_end":
                end = self._value_end(self._buf)
                if end is None:  # layout (or keys after the arguments) of a call whose end is to come
                    self._take_scanned(len(self._buf))
                    return
                self._take(end)
                self._state = "separator"
            if self._state == "separator":
                stripped = self._buf.lstrip()
                if not stripped:
                    if final:
                        self._take(len(self._buf))
                    return
                if stripped.startswith(";"):
                    # Kept, like the tag, for the content if what follows is not a call.
                    self._raw_tag = self._take(len(self._buf) - len(stripped) + 1)
                    self._state = "calls"
                else:
                    self._state = "failed"


class MistralParser(StreamingToolParser):
    MARKER = "[TOOL_CALLS]"

    def __init__(self, id_factory: Callable[[], str] = mistral_call_id):
        super().__init__(id_factory)
        self._in_calls = False
        self._failed = False  # calls that did not parse: all the rest is content

    def _advance(self, final: bool) -> None:
        while True:
            if self._failed:
                self._emit_content(self._take(len(self._buf)))
                return
            if not self._in_calls:
                if not self._content_until(self.MARKER, final):
                    return
                self._in_calls = True
            stripped = self._buf.lstrip()
            opens = stripped[:1] in ("[", "{")
            end = self._value_end(stripped) if opens else None
            if end is None and not final and (not stripped or opens):
                return
            calls = None
            if end is not None:
                value = loads_or_none(stripped[:end])
                items = value if isinstance(value, list) else [value]
                calls = [call_of(item, "arguments") for item in items] if items else None
            elif self._truncated:  # cut inside the list: its complete calls, and the rest withheld
                self._take(len(self._buf))
                for item in complete_items(stripped):
                    call = as_call(item, "arguments")
                    if call is None:
                        break
                    self._emit_call(*call)
                return
            if calls is None or None in calls:
                self._emit_content(self.MARKER)
                self._failed = True
                continue
            self._take(len(self._buf) - len(stripped) + end)
            for call in calls:
                self._emit_call(*call)
            self._in_calls = False


class ToolParser:
    """One format's parser: `parse` a whole text, or `streaming()` for deltas."""

    def __init__(self, name: str, streaming_class: type[StreamingToolParser]):
        self.name = name
        self._streaming_class = streaming_class

    def streaming(self, id_factory: Callable[[], str] | None = None) -> StreamingToolParser:
        return self._streaming_class() if id_factory is None else self._streaming_class(id_factory)

    def parse(self, text: str, id_factory: Callable[[], str] | None = None, *,
              truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole text; content is None when it would be empty. truncated: the
        text was cut short (see StreamingToolParser.finish)."""
        parser = self.streaming(id_factory)
        return assemble([parser.feed(text), parser.finish(truncated)])


TOOL_PARSERS = types.MappingProxyType({
    "hermes": ToolParser("hermes", HermesParser),
    "llama3_json": ToolParser("llama3_json", Llama3JsonParser),
    "mistral": ToolParser("mistral", MistralParser),
})


def get_tool_parser(name: str) -> ToolParser:
    """The parser of `--tool-call-parser NAME`; ValueError listing the known names."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def assemble(deltas) -> tuple[str | None, list[ToolCall]]:
    """Put streamed deltas back together: (content or None, calls), as a client would."""
    content = "".join(delta.content for delta in deltas)
    calls: dict[int, list] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index not in calls:
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    return content or None, [ToolCall(*calls[index]) for index in sorted(calls)]
