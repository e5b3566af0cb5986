"""Tool-call parsers on hand-written model outputs; streamed deltas add up to the whole-text parse."""

from __future__ import annotations

import itertools
import json
import re
import time

import numpy as np
import pytest

from orca_jax.structured.tool_parsers import (TOOL_PARSERS, ParsedDelta, ToolCall, ToolCallDelta, assemble,
                                              get_tool_parser, mistral_call_id, openai_call_id)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": [2, "]}"]}}'


def counter_ids():
    numbers = itertools.count()
    return lambda: f"id{next(numbers)}"


def calls(*pairs):
    """Calls of (name, arguments): a dict, or the arguments' raw text (a streamed call cut short)."""
    return [ToolCall(f"id{i}", name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            for i, (name, args) in enumerate(pairs)]


W_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})
A_CALL = ("add", {"a": 1, "b": [2, "]}"]})

CASES = {
    "hermes": [
        (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [W_CALL]),
        (f"Let me check both.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>\n",
         "Let me check both.", [W_CALL, A_CALL]),
        # Arguments that never close are what the model wrote: a call once its head was read.
        ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"\n</tool_call>",
         None, [("get_weather", '{"city": "Paris"\n')]),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2', None, [("add", '{"a": 1, "b": [2')]),  # cut
        (f"<tool_call>{ADD}</tool_call> then <tool_call>{{oops}}</tool_call>",
         "then <tool_call>{oops}</tool_call>", [A_CALL]),
        ("The answer is 4.\n", "The answer is 4.\n", []),
        (f"<tool_call>\n{WEATHER}", None, [W_CALL]),  # stopped before the closing tag
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": [2, \\"]}\\"]}"}</tool_call>', None,
         [A_CALL]),  # arguments written as a JSON string
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ("Use <tool to go, a < b and x</tool_call>", "Use <tool to go, a < b and x</tool_call>", []),
        ("<tool_call>\n{\"name\": \"add\", \"arg", None, [("add", "")]),  # cut after the name
        ("<tool_call>\n{\"name\": \"ad", "<tool_call>\n{\"name\": \"ad", []),  # cut inside it
        ("", None, []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [W_CALL]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "add", "parameters": {"a": 1, "b": [2, "]}"]}}', None, [W_CALL, A_CALL]),
        (' \n{"name": "add", "arguments": {"a": 1, "b": [2, "]}"]}}', None, [A_CALL]),
        ("Paris is sunny today.", "Paris is sunny today.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),  # an answer, not a call
        ('{"name": "add", "parameters": {"a": 1, "b": [2, "]}"]}}; {"name": broken',
         '; {"name": broken', [A_CALL]),
        ('{"name": "add", "parameters": {"a": 1, "b": [2, "]}"]}} and some words', "and some words", [A_CALL]),
        ('I will call it. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
         '"celsius"}}', "I will call it.", [W_CALL]),
        ('<|python_tag|>{"name": ', '<|python_tag|>{"name": ', []),
        ('{"name": "add", "parameters": {"a": 1, "b": [2', None, [("add", '{"a": 1, "b": [2')]),  # cut
        ('{"name": "add", "parameters": {"a": 1}, "x": {"}": 2}}; {"name": "add", "parameters": {}}', None,
         [("add", '{"a": 1}'), ("add", "{}")]),  # keys after the arguments are skipped
        ("<|python", "<|python", []),
    ],
    "mistral": [
        (f"[TOOL_CALLS][{WEATHER}, {ADD}]", None, [W_CALL, A_CALL]),
        (f"Sure.[TOOL_CALLS] [{ADD}]", "Sure.", [A_CALL]),
        (f"[TOOL_CALLS]{WEATHER}", None, [W_CALL]),
        ("[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {]", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {]", []),
        ("[TOOL_CALLS] not json [TOOL_CALLS][]", "[TOOL_CALLS] not json [TOOL_CALLS][]", []),
        ("No tools needed [TOOL", "No tools needed [TOOL", []),
    ],
}


@pytest.mark.parametrize("parser, text, content, expected",
                         [(p, *case) for p, cases in CASES.items() for case in cases])
def test_parse(parser, text, content, expected):
    got_content, got_calls = get_tool_parser(parser).parse(text, counter_ids())
    assert got_content == content
    assert got_calls == calls(*expected)
    for call, (_, args) in zip(got_calls, expected):
        if not isinstance(args, str):
            assert json.loads(call.arguments) == args


@pytest.mark.parametrize("parser, text", [(p, case[0]) for p, cases in CASES.items() for case in cases])
def test_streaming_adds_up_to_parse(parser, text):
    whole = get_tool_parser(parser).parse(text, counter_ids())
    rng = np.random.default_rng(len(text))
    splits = [[1] * len(text), [len(text)]] + [rng.integers(1, 8, size=len(text)).tolist() for _ in range(6)]
    for sizes in splits:
        stream = get_tool_parser(parser).streaming(counter_ids())
        deltas, at = [], 0
        for size in sizes:
            if at >= len(text):
                break
            deltas.append(stream.feed(text[at:at + size]))
            at += size
        deltas.append(stream.finish())
        assert assemble(deltas) == whole, sizes
        _check_openai_shape(deltas)


def _check_openai_shape(deltas: list[ParsedDelta]):
    """A call's first piece carries index, id and name; later pieces only argument text."""
    seen = set()
    for piece in (p for d in deltas for p in d.tool_calls):
        assert isinstance(piece, ToolCallDelta)
        if piece.index in seen:
            assert piece.id is None and piece.name is None
        else:
            assert piece.index == len(seen) and piece.id and piece.name
            seen.add(piece.index)


def test_streaming_emits_as_soon_as_certain():
    stream = get_tool_parser("hermes").streaming(counter_ids())
    assert stream.feed("Let me check") == ParsedDelta("Let me check")
    assert stream.feed(" the weather.\n<tool") == ParsedDelta(" the weather.")  # "<tool" may begin a tag
    assert stream.feed("_call>\n" + WEATHER[:20]) == ParsedDelta()
    delta = stream.feed(WEATHER[20:] + "\n</tool_call>")
    assert delta.tool_calls == (ToolCallDelta(0, "id0", "get_weather"),
                                ToolCallDelta(0, arguments='{"city": "Paris", "unit": "celsius"}'))
    assert stream.finish() == ParsedDelta()


def test_hermes_arguments_stream_as_they_are_generated():
    stream = get_tool_parser("hermes").streaming(counter_ids())
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arguments": ') == ParsedDelta()
    assert stream.feed("{") == ParsedDelta(tool_calls=(ToolCallDelta(0, "id0", "get_weather"),
                                                       ToolCallDelta(0, arguments="{")))
    assert stream.feed('"city": "Par') == ParsedDelta(tool_calls=(ToolCallDelta(0, arguments='"city": "Par'),))
    # "</" may begin the closing tag: held back until it cannot
    assert stream.feed('is</') == ParsedDelta(tool_calls=(ToolCallDelta(0, arguments="is"),))
    assert stream.feed('b>"}') == ParsedDelta(tool_calls=(ToolCallDelta(0, arguments='</b>"}'),))
    assert stream.feed("}\n</tool_call>") == ParsedDelta()
    assert stream.finish() == ParsedDelta()


def test_llama3_json_arguments_stream_as_they_are_generated():
    stream = get_tool_parser("llama3_json").streaming(counter_ids())
    assert stream.feed('{"name": "add", "parameters": ') == ParsedDelta()
    assert stream.feed('{"a"') == ParsedDelta(tool_calls=(ToolCallDelta(0, "id0", "add"),
                                                          ToolCallDelta(0, arguments='{"a"')))
    assert stream.feed(': 1, "b": "}"') == ParsedDelta(tool_calls=(ToolCallDelta(0, arguments=': 1, "b": "}"'),))
    assert stream.feed("}}; ") == ParsedDelta(tool_calls=(ToolCallDelta(0, arguments="}"),))
    assert stream.feed('{"name": "now", "parameters": {}}') == ParsedDelta(tool_calls=(
        ToolCallDelta(1, "id1", "now"), ToolCallDelta(1, arguments="{}")))
    assert stream.finish() == ParsedDelta()


def test_registry_and_ids():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("pythonic")
    assert re.fullmatch(r"call_[0-9a-f]{24}", openai_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral_call_id())
    _, (call,) = get_tool_parser("mistral").parse(f"[TOOL_CALLS][{ADD}]")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    _, (call,) = get_tool_parser("hermes").parse(f"<tool_call>{ADD}</tool_call>")
    assert call.id.startswith("call_")


@pytest.mark.parametrize("parser, template", [
    ("llama3_json", '{{"name": "write", "parameters": {{"text": "{}"}}}}'),
    ("mistral", '[TOOL_CALLS][{{"name": "write", "arguments": {{"text": "{}"}}}}]'),
    ("hermes", '<tool_call>{{"name": "write", "arguments": {{"text": "{}"}}}}</tool_call>'),
])
def test_long_arguments_stream_in_linear_time(parser, template):
    body = "x{[\\\"]}" * 4000  # 28,000 characters of brackets, quotes and escapes inside one string
    text = template.format(body)
    stream = get_tool_parser(parser).streaming(counter_ids())
    start = time.process_time()  # CPU time: what other processes on a busy host take does not count
    deltas = [stream.feed(char) for char in text] + [stream.finish()]
    assert time.process_time() - start < 5.0  # a rescan per character would take minutes
    assert assemble(deltas) == (None, [ToolCall("id0", "write", json.dumps({"text": json.loads(f'"{body}"')}))])


# Two calls after some words, in each format: a text cut by max_tokens anywhere in it.
LEAD = "Let me check both.\n"
TWO_CALLS = {
    "hermes": f"{LEAD}<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>",
    "llama3_json": (f'{LEAD}<|python_tag|>{WEATHER.replace("arguments", "parameters")}; '
                    f'{ADD.replace("arguments", "parameters")}'),
    "mistral": f"{LEAD}[TOOL_CALLS][{WEATHER}, {ADD}]",
}


def _parse_streamed(parser: str, text: str, sizes: list[int], truncated: bool):
    stream = get_tool_parser(parser).streaming(counter_ids())
    deltas, at = [], 0
    for size in sizes:
        deltas.append(stream.feed(text[at:at + size]))
        at += size
    return assemble(deltas + [stream.finish(truncated)])


@pytest.mark.parametrize("parser", sorted(TWO_CALLS))
def test_a_text_cut_anywhere_in_a_call_or_its_opener_has_no_markup_in_its_content(parser):
    """At every cut, streamed (one character at a time, and in pieces) and not: the content is the words
    before the calls, never a piece of an opener or of a call; the calls are those written, the last
    one's arguments as far as they got (or, cut before they could be read, no call)."""
    full = TWO_CALLS[parser]
    _, expected = get_tool_parser(parser).parse(full, counter_ids())
    assert [c.name for c in expected] == ["get_weather", "add"]
    rng = np.random.default_rng(0)
    for cut in range(len(full) + 1):
        text = full[:cut]
        content, got = get_tool_parser(parser).parse(text, counter_ids(), truncated=True)
        assert (content or "").strip() == LEAD[:cut].strip(), (cut, content)
        assert [c.name for c in got] == [c.name for c in expected[:len(got)]], (cut, got)
        for call, whole in zip(got, expected):
            assert whole.arguments.replace(" ", "").startswith(call.arguments.replace(" ", "")), (cut, call)
        for sizes in ([1] * cut, rng.integers(1, 6, size=cut).tolist()):
            assert _parse_streamed(parser, text, sizes, truncated=True) == (content, got), (cut, sizes)


@pytest.mark.parametrize("parser, opener", [("hermes", "<tool_call>"), ("llama3_json", "<|python_tag|>"),
                                            ("mistral", "[TOOL_CALLS]")])
def test_an_opener_cut_at_every_character_is_withheld_but_kept_when_the_model_ended_there(parser, opener):
    for cut in range(1, len(opener)):
        text = "Sure. " + opener[:cut]
        assert get_tool_parser(parser).parse(text, truncated=True) == ("Sure. ", []), cut
        assert _parse_streamed(parser, text, [1] * len(text), truncated=True) == ("Sure. ", []), cut
        # The model's own end (finish_reason "stop"): what it wrote is content.
        assert get_tool_parser(parser).parse(text) == (text, []), cut
