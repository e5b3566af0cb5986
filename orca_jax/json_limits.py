"""JSON from outside, bounded before it is parsed: nesting depth, and numbers that must be finite (numpy; no jax).

Python's json parser and every recursive walk after it (pydantic's, our own, a chat template's)
use the interpreter's stack, so JSON nested a few hundred levels deep raises RecursionError far from
where it came in. `check_depth` measures the nesting of JSON text without parsing it, in a few
vectorised passes (linear in the text's size), so a door can refuse it with a message naming the
limit. Strings are found by their unescaped quotes (a quote after an odd run of backslashes is
escaped), so brackets inside strings do not count. Text that is not JSON may be measured wrongly,
but the parser refuses it afterwards anyway.

`loads` is json.loads behind that check, with NaN and Infinity (Python's extension, not JSON)
refused. `finite_or_none` makes a value safe for a JSON response, which has no NaN either.
"""

from __future__ import annotations

import json
import math

import numpy as np

# The default bound on nesting: deep enough for any request the API describes (a JSON schema of a
# dozen nested objects is ~30 levels), shallow enough that every recursive walk stays far from
# Python's stack limit (1,000 frames).
DEFAULT_MAX_DEPTH = 64
MAX_DEPTH_LIMIT = 256  # the largest bound a flag may set: walks of two frames per level still fit

# Per byte value: +1 opening an array or object, +1 closing one (read-only tables).
_OPEN = np.isin(np.arange(256), [ord("["), ord("{")]).astype(np.int32)
_CLOSE = np.isin(np.arange(256), [ord("]"), ord("}")]).astype(np.int32)
_OPEN.flags.writeable = _CLOSE.flags.writeable = False


class JSONLimitError(ValueError):
    """JSON beyond a limit, or not JSON; the message says which rule it broke (never its content)."""


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (0 for a scalar)."""
    data = np.frombuffer(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text, np.uint8)
    if not data.size:
        return 0
    # Length of the run of backslashes ending at each byte: a segmented cumulative count.
    backslash = (data == ord("\\")).astype(np.int32)
    count = np.cumsum(backslash)
    run = count - np.maximum.accumulate(np.where(backslash == 0, count, 0))
    before = np.concatenate([[0], run[:-1]])  # the run just before each byte
    quote = (data == ord('"')) & (before % 2 == 0)
    outside = np.cumsum(quote) % 2 == 0  # an even number of quotes up to here: not inside a string
    steps = np.where(outside & ~quote, _OPEN[data] - _CLOSE[data], 0)
    return int(np.cumsum(steps).max(initial=0))


def check_depth(text: str | bytes, max_depth: int, what: str) -> None:
    """JSONLimitError naming `what` if its JSON nests deeper than max_depth."""
    opens = text.count("[") + text.count("{") if isinstance(text, str) else text.count(b"[") + text.count(b"{")
    if opens > max_depth and json_depth(text) > max_depth:  # few brackets (most bodies) cannot nest deep
        raise JSONLimitError(f"{what} nests arrays and objects more than {max_depth} levels deep")


class _NotANumber(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NotANumber(f"{name} is not a JSON number (numbers must be finite)")


# One decoder for every call (stateless): json.loads builds a new one per call when given
# parse_constant, a third of the time of parsing a short JSONL line.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def loads(text: str | bytes, what: str, max_depth: int = DEFAULT_MAX_DEPTH):
    """json.loads for JSON from outside: JSONLimitError (naming `what` and the rule, not the text) for
    nesting beyond max_depth, NaN or Infinity, or text that is not JSON."""
    check_depth(text, max_depth, what)
    try:
        return _DECODER.decode(text.decode("utf-8") if isinstance(text, bytes) else text)
    except json.JSONDecodeError as error:
        raise JSONLimitError(f"{what} is not valid JSON ({error.msg} at line {error.lineno}, column "
                             f"{error.colno})") from None
    except UnicodeDecodeError:
        raise JSONLimitError(f"{what} is not UTF-8 text") from None
    except _NotANumber as error:
        raise JSONLimitError(f"{what}: {error}") from None
    except RecursionError:  # only if max_depth was set beyond what the stack holds
        raise JSONLimitError(f"{what} nests too deeply to parse") from None


def finite_or_none(value: float | None) -> float | None:
    """A float a JSON response can carry: NaN and the infinities become None."""
    return value if value is None or math.isfinite(value) else None
