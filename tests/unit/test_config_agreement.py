"""The cross-rank config agreement: what it names when two ranks composed different configs."""

from __future__ import annotations

from flodl.links.group import _differences


def test_differences_of_equal_configs_is_empty():
    cfg = {"a": 1, "n": {"b": [1, 2], "c": {"d": "x"}}}
    assert _differences(cfg, {"a": 1, "n": {"b": [1, 2], "c": {"d": "x"}}}) == []


def test_differences_names_nested_keys():
    a = {"seed": 1, "task": {"model": {"hidden": 128}, "name": "digits"}, "gamma": 1.0}
    b = {"seed": 1, "task": {"model": {"hidden": 64}, "name": "digits", "extra": 3}, "gamma": 0.5}
    assert _differences(a, b) == [
        "gamma (rank 0: 1.0, other: 0.5)",
        "task.extra (rank 0: '<absent>', other: 3)",
        "task.model.hidden (rank 0: 128, other: 64)",
    ]


def test_differences_dict_against_scalar():
    assert _differences({"launch": {"n": 1}}, {"launch": 5}) == ["launch (rank 0: {'n': 1}, other: 5)"]


def test_differences_tells_an_absent_key_from_a_null_one():
    assert _differences({"a": None}, {}) == ["a (rank 0: None, other: '<absent>')"]
