"""`dumps_indented` writes exactly what `json.dumps(value, indent=2, ensure_ascii=False)` writes, and leaves
what it does not handle to it."""

import json
import math

import pytest

from builder.envs.jsontext import dumps_indented
from builder.sandbox.bench import sized_state

VALUES = [
    {},
    [],
    "",
    0,
    None,
    True,
    1.5,
    -0.0,
    1e16,
    1e-7,
    math.inf,
    -math.inf,
    math.nan,
    2**70,
    {"a": [], "b": {}, "c": [[], {}], "d": [1, "x", None, False, 2.5]},
    {"ünïcode": 'snow ☃ \u2028 \x00 " \\ \n', "emoji": ["😀", {"k": "\ud800"}]},
    [{"a": 1}, [1, [2, [3, {"b": [True]}]]], "tail"],
    {"1": {"nested": {"deep": {"leaf": [1, 2, 3]}}}},
    sized_state(20_000),
]


@pytest.mark.parametrize("value", VALUES)
def test_the_same_text_as_json_dumps(value):
    assert dumps_indented(value) == json.dumps(value, indent=2, ensure_ascii=False)


@pytest.mark.parametrize("value", [{1: "int key"}, {"t": (1, 2)}, {"k": {None: 1, 2.5: [1]}}, [1, (2, [3])]])
def test_other_types_are_left_to_json_dumps(value):
    assert dumps_indented(value) == json.dumps(value, indent=2, ensure_ascii=False)


def test_errors_are_json_dumps_errors():
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference"):
        dumps_indented({"x": cycle})
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps_indented({"x": {1, 2}})


def test_lists_of_flat_records_with_tricky_strings():
    value = {"rows": [{"a": "},\n{", "b": "[{ }]"}, {"c": 1}], "mixed": [{"a": 1}, {}], "nested": [[{"x": "}]"}]]}
    assert dumps_indented(value) == json.dumps(value, indent=2, ensure_ascii=False)
