"""The base of every request body: strict values, lenient about fields it does not know.

Values are strict (a string is not an int, NaN is not a float, a lone surrogate is not text), so a
mistake is a 400 naming the field; NaN and Infinity, which Python's JSON parser takes but JSON has
not, are refused anywhere in a body, inside free-form fields like a JSON schema too. Fields the server does not know are kept aside and ignored, as
vLLM ignores them: clients and agent frameworks send many (`store`, `metadata`, `service_tier`,
`"functions": null`), and refusing them would lock those clients out. The server logs each such
field name once (`ignored_fields`), so a misspelt `max_token` still shows up in the log.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


def _unicode_problem(text: str) -> str | None:
    """Why `text` cannot be UTF-8 (a lone surrogate like "\\ud800", which JSON allows), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"a lone surrogate {text[error.start]!r} at character {error.start}"
    return None


def _check_encodable(value: object) -> None:
    """ValueError for a string JSON allows but UTF-8 does not, anywhere in `value` (iterative: a
    client's nesting never reaches the interpreter's stack)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            problem = _unicode_problem(item)
            if problem is not None:
                raise ValueError(f"the text is not valid Unicode: {problem}")
        elif isinstance(item, (list, tuple)):
            if not _only_numbers(item):  # a prompt's thousands of token ids need no look each
                pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())


def _only_numbers(items: list | tuple) -> bool:
    # set(map(type, ...)) runs in C: ~10 ms for a 2 MB body's million token ids, against ~80 in a loop.
    return set(map(type, items)) <= _NUMBERS


_NUMBERS = frozenset({int, bool})


class FieldValueError(ValueError):
    """A value refused by a check across the whole body; `param` names its top-level field (the
    error's location is the body's, as for any model validator)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _integral_floats_to_int(value: object) -> object:
    """1.0 -> 1, in lists and objects too: JSON does not tell 1.0 from 1 (nor does JSON Schema's
    "integer"), but a strict int field would refuse the float. Float fields take ints as they are.
    FieldValueError naming the field for NaN or an infinity, and for an object key that is not
    Unicode (a lone surrogate). Iterative, and copies only what holds a float: a body's nesting never
    reaches the interpreter's stack, and a million token ids are looked at in C."""
    root = [value]
    # (container, key, path): container[key] is the value to look at; path is (its parent's path, key)
    # as a linked pair, spelt out only for an error.
    pending: list[tuple[list | dict, object, tuple | None]] = [(root, 0, None)]
    while pending:
        container, key, path = pending.pop()
        item = container[key]
        if isinstance(item, float):
            container[key] = _json_number(item, path)
        elif isinstance(item, list):
            if set(map(type, item)) <= _NOTHING_TO_CONVERT:
                continue  # nothing to convert or look into (the common case: token ids, texts)
            item = container[key] = list(item)
            pending.extend((item, i, (path, i)) for i in range(len(item)))
        elif isinstance(item, dict):
            for name in item:
                problem = _unicode_problem(name) if isinstance(name, str) else None
                if problem is not None:
                    where = _dotted(path)
                    raise FieldValueError(f"{where + ': a' if where else 'A'} field name is not valid Unicode: {problem}",
                                          _top_level(path))
            item = container[key] = dict(item)
            pending.extend((item, name, (path, name)) for name in item)
    return root[0]


_NOTHING_TO_CONVERT = frozenset({int, bool, str, type(None)})


def _json_number(value: float, path: tuple | None) -> int | float:
    if not math.isfinite(value):
        spelt = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")  # as they came
        raise FieldValueError(f"{_dotted(path) or 'the body'}: {spelt} is not a JSON number (numbers must be finite)",
                              _top_level(path))
    return int(value) if value.is_integer() else value


def _dotted(path: tuple | None) -> str:
    """A linked path (((None, "messages"), 0), "content") as "messages.0.content"."""
    parts = []
    while path is not None:
        path, key = path
        parts.append(str(key))
    return ".".join(reversed(parts))


def _top_level(path: tuple | None) -> str | None:
    dotted = _dotted(path)
    return dotted.split(".")[0] if dotted else None


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: object) -> object:
        return _integral_floats_to_int(data)

    @field_validator("*")
    @classmethod
    def _encodable(cls, value: object) -> object:
        # Nested bodies (messages, content parts) check their own fields, so the error names them.
        _check_encodable(value)
        return value


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `body` and the bodies inside it did not know (list items share
    their list's name: `messages.reasoning`)."""
    names = [prefix + name for name in (body.model_extra or {})]
    for name in type(body).model_fields:
        value = getattr(body, name)
        for item in value if isinstance(value, list) else (value,):
            if isinstance(item, StrictBody):
                names += ignored_fields(item, f"{prefix}{name}.")
    return names
