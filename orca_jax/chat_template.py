"""Chat templates rendered as transformers renders them, and where each message's content lands.

The template sees what `transformers`' `apply_chat_template` gives it: `messages` (dicts whose
assistant turns may carry `tool_calls` with their arguments as objects, and tool turns a
`tool_call_id`), `tools` (OpenAI's tool objects, or None), `add_generation_prompt`, `bos_token`
and `eos_token`, in the same sandboxed jinja2 environment, so prompts match byte for byte.
"""

from __future__ import annotations

import bisect
import collections
import datetime
import functools
import json
import re
import uuid
from typing import Callable

import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON, as transformers gives.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in, so whitespace handling matches.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    # Llama 3.1+ templates print today's date with it (and fall back to a fixed date without it).
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, *,
                         tools: list[dict] | None = None, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text of a conversation; `tools` is passed as None when there are none, as
    transformers does (templates test `tools is not none`)."""
    return compile_chat_template(template).render(
        messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
        bos_token=bos_token, eos_token=eos_token)


Render = Callable[[list[dict]], str]


def content_spans(render: Render, messages: list[dict], prompt: str) -> list[tuple[int, int]] | None:
    """Where each message's content lies in `prompt` (= render(messages)) as [start, end) character
    spans, or None.

    Renders once more with a unique marker in place of each non-empty content, then checks that
    putting the contents back (as is, or stripped, for templates that `trim`) gives `prompt`
    exactly. None when it does not: the template rewrites content in a way we cannot follow. Empty
    contents (an assistant turn that only calls tools) stay as they are: a template may test them.
    """
    nonce = uuid.uuid4().hex
    markers = [f"\ue000{nonce}:{index}\ue001" if message.get("content") else None
               for index, message in enumerate(messages)]
    marked = [message if marker is None else {**message, "content": marker}
              for message, marker in zip(messages, markers)]
    rendered = render(marked)
    # Every marker in one pass (a search per message was quadratic: 10,001 messages took seconds).
    found = [(match.start(), int(match.group(1))) for match in
             re.finditer(re.escape(f"\ue000{nonce}:") + r"(\d+)\ue001", rendered)]
    if any(count > 1 for count in collections.Counter(index for _, index in found).values()):
        return None
    places = [(at, markers[index], messages[index]["content"]) for at, index in found
              if index < len(messages) and markers[index] is not None]
    for transform in (lambda text: text, str.strip):
        spans, pieces, cursor, shift = [], [], 0, 0
        for at, marker, content in places:
            content = transform(content)
            pieces += [rendered[cursor:at], content]
            spans.append((at + shift, at + shift + len(content)))
            shift += len(content) - len(marker)
            cursor = at + len(marker)
        if "".join(pieces) + rendered[cursor:] == prompt:
            return spans
    return None


def overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether [start, end) meets one of `spans` (sorted and disjoint, as content_spans gives them)."""
    j = max(0, bisect.bisect_right(spans, (start, float("inf"))) - 1)  # the last span starting by `start`
    while j < len(spans) and spans[j][0] < end:
        if start < spans[j][1]:
            return True
        j += 1
    return False


# A tool no template knows: its name appears in a render only when the template writes tools out.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "orca_probe_3f9a", "description": "probe", "parameters": {"type": "object", "properties": {}}}}


@functools.lru_cache(maxsize=16)
def renders_tools(template: str) -> bool:
    """Whether `template` writes the `tools` it is given into the prompt (checked once per template:
    a conversation rendered with a probe tool and without, compared). SmolLM2's does not: it drops
    them without a word. A template that fails on the probe is taken to render them (it is left alone)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        with_tools = render_chat_template(template, messages, True, tools=[_PROBE_TOOL])
        without = render_chat_template(template, messages, True)
    except jinja2.TemplateError:
        return True
    return with_tools != without and _PROBE_TOOL["function"]["name"] in with_tools
