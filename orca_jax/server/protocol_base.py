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


def _check_encodable(value: object) -> None:
    """ValueError for a string JSON allows but UTF-8 does not (a lone surrogate like "\\ud800")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate {value[error.start]!r} "
                             f"at character {error.start}") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            if not isinstance(item, int):  # a prompt's hundreds of token ids need no call each
                _check_encodable(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key)
            _check_encodable(item)


class FieldValueError(ValueError):
    """A value refused by a check across the whole body; `param` names its top-level field (the
    error's location is the body's, as for any model validator)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _integral_floats_to_int(value: object, path: str = "") -> object:
    """1.0 -> 1, in lists and objects too: JSON does not tell 1.0 from 1 (nor does JSON Schema's
    "integer"), but a strict int field would refuse the float. Float fields take ints as they are.
    ValueError naming the field for NaN or an infinity. (One frame per level: the body's nesting is
    bounded before it is parsed, middleware.BodyLimitMiddleware.)"""
    if isinstance(value, float):
        if not math.isfinite(value):
            spelt = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")  # as they came
            raise FieldValueError(f"{path or 'the body'}: {spelt} is not a JSON number (numbers must be finite)",
                                  path.split(".")[0] if path else None)
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_integral_floats_to_int(item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value)]
    if isinstance(value, dict):
        return {key: _integral_floats_to_int(item, f"{path}.{key}" if path else str(key))
                for key, item in value.items()}
    return value


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
