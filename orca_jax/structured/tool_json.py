"""JSON scanning for the tool-call parsers (tool_parsers.py): a call object's head, a call read out of
its JSON text, where a growing text's object ends, and how much of a marker a text's end begins."""

from __future__ import annotations

import json
import re


# A hermes call's head, up to where its arguments' value begins; its name alone; a llama3_json call's head.
CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
CALL_HEAD = re.compile(CALL_NAME.pattern + r'\s*,\s*"arguments"\s*:\s*')
JSON_CALL_HEAD = re.compile(CALL_NAME.pattern + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def as_call(text: str, *argument_keys: str) -> tuple[str, str] | None:
    return call_of(loads_or_none(text.strip()), *argument_keys)


def call_of(value, *argument_keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    # The arguments key is required (as vLLM's parsers do): `{"name": "Ada", "age": 36}` is an answer.
    key = next((key for key in argument_keys if key in value), None)
    if key is None:
        return None
    arguments = value[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = loads_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def may_begin_call(text: str) -> bool:
    """Whether a JSON text cut short may be a call object: `{` and "name" as its first key, as far
    as the text goes (`{`, `{"na`, `{"name": "ad`). An answer whose first key is "name" reads the same."""
    if not text.startswith("{"):
        return False
    key = text[1:].lstrip()
    return key.startswith('"name"') or '"name"'.startswith(key)


def complete_items(text: str) -> list[str]:
    """The complete objects at the start of a JSON array cut short (`[{...}, {...}, {"na` gives two)."""
    items, at = [], 1 if text.startswith("[") else len(text)
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if not text.startswith("{", at):
            break
        end = ValueEnd()(text[at:])
        if end is None:
            break
        items.append(text[at:at + end])
        at += end
    return items


def loads_or_none(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


class ValueEnd:
    """Where the object or array at the start of a growing text ends; each call scans only the
    text added since the last (arguments can be long: a file's content), until reset()."""

    def __init__(self):
        self.reset()

    def reset(self, depth: int = 0) -> None:
        """Scan anew, from `depth` brackets deep (1: inside an object whose end is wanted)."""
        self._scanned, self._depth, self._in_string, self._escaped = 0, depth, False, False

    def drop(self, count: int) -> None:
        """The first `count` characters, all scanned, were removed from the text."""
        self._scanned -= count

    def __call__(self, text: str) -> int | None:
        """Index after the closing bracket, or None when the text ends first. Brackets inside
        strings do not count. `text` must extend the text of the previous call."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for index in range(self._scanned, len(text)):
            char = text[index]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self.reset()
                    return index + 1
        self._scanned, self._depth, self._in_string, self._escaped = len(text), depth, in_string, escaped
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
