"""json_limits: nesting measured without parsing (strings and escapes understood), NaN refused, and
the measure linear in the text's size."""

from __future__ import annotations

import json
import time

import pytest

from orca_jax.json_limits import JSONLimitError, check_depth, finite_or_none, json_depth, loads


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ('"[[["', 0), ("[]", 1), ("[[1],[2,[3]]]", 3), ('{"a": "[[[[", "b": [1]}', 2),
    (r'{"a": "x\"[[[", "b": [[1]]}', 3),  # an escaped quote does not end the string
    (r'["\\", [[]]]', 3),  # an escaped backslash does not escape the quote after it
    (r'["\\\"[", []]', 2), ('{"a": {"b": {"c": []}}}', 4), ("[" * 3000 + "]" * 3000, 3000),
])
def test_depth_follows_json_structure_not_brackets_in_strings(text, depth):
    assert json_depth(text) == depth == json_depth(text.encode())
    parsed_depth = _depth_of(json.loads(text)) if depth < 500 else depth
    assert parsed_depth == depth


def _depth_of(value) -> int:
    if isinstance(value, (list, dict)):
        items = value.values() if isinstance(value, dict) else value
        return 1 + max((_depth_of(item) for item in items), default=0)
    return 0


def test_loads_refuses_deep_nesting_nan_and_non_json_naming_the_rule():
    with pytest.raises(JSONLimitError, match="the body nests arrays and objects more than 64 levels deep"):
        loads("[" * 65 + "]" * 65, "the body")
    loads("[" * 64 + "]" * 64, "the body")
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(JSONLimitError, match=f"x: {constant} is not a JSON number"):
            loads(f'{{"a": [{constant}]}}', "x")
    with pytest.raises(JSONLimitError, match=r"x is not valid JSON \(Expecting value at line 1, column 6\)"):
        loads('{"a":', "x")
    assert loads('{"a": "\u2028"}', "x") == {"a": "\u2028"}
    with pytest.raises(JSONLimitError, match="more than 3 levels"):
        check_depth(b"[[[[1]]]]", 3, "it")
    assert finite_or_none(float("nan")) is None and finite_or_none(1.5) == 1.5 and finite_or_none(None) is None


def test_measuring_is_linear_in_size():
    """Escaped quotes everywhere: a regex for strings backtracks quadratically on such text."""
    body = json.dumps({"a": ['\\"[{' * 100_000] * 5})
    start = time.perf_counter()
    assert json_depth(body) == 2
    assert time.perf_counter() - start < 2
