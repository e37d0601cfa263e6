"""The configuration reference (docs/configuration.md) is what `python -m flodl.config.reference` writes
from the schema: every key, its default, the comment above it, the values the rules allow."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from flodl.config import schema
from flodl.config.reference import main, read_source, reference
from flodl.config.rules import CHOICES, NULL_MEANS


def rows(markdown: str) -> dict[str, list[str]]:
    """Each table row's cells after the key, by key."""
    found = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            found[cells[0].strip("`")] = cells[1:]
    return found


def leaf_keys(node: DictConfig, prefix: str = "") -> set[str]:
    keys = set()
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig) and child._metadata.object_type not in (None, dict):
            keys |= leaf_keys(child, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_every_key_of_the_schema_has_a_row_with_its_default_and_comment() -> None:
    table = rows(reference())
    assert set(table) == leaf_keys(OmegaConf.structured(schema.FlodlConfig))
    assert table["launch.timeout_s"][:2] == ["`float`", "`300.0`"]
    assert table["launch.timeout_s"][3].startswith("Seconds a rank waits for the rendezvous")
    assert table["task.model"][1] == "*required*" and table["task.eval_data"][1] == "`null`"
    assert (table["callbacks"][1], table["logger.tags"][1], table["debug.stager"][1]) == (
        "`[]`",
        "`null`",
        "`true`",
    )
    assert table["max_grad_norm"][0] == "`float \\| None`"  # a pipe inside a cell is escaped
    undescribed = sorted(key for key, cells in table.items() if not cells[3])
    assert undescribed == [], f"keys without a comment above them in flodl/config/schema.py: {undescribed}"


def test_every_tuple_of_allowed_values_in_the_schema_reaches_its_key() -> None:
    table = rows(reference())
    tuples = {
        name: value for name, value in vars(schema).items() if name.isupper() and isinstance(value, tuple)
    }
    listed = {cells[2] for cells in table.values()}
    missing = [name for name, values in tuples.items() if ", ".join(f"`{v}`" for v in values) not in listed]
    assert missing == [], "a schema tuple no rule checks a key against (flodl/config/rules/values.py)"
    assert table["policy"][2] == "`sync`, `cadence`, `async`"
    assert table["simulate.kill_in"][2] == "`window`, `round`, `start`"  # a tuple written in the rule


SOURCE = '''
@dataclass
class Sample:
    """What it is."""

    # --- first part ---
    # Two lines
    # of comment.
    a: int = 1
    b: int = 2

    # Not b's, nor c's: blank lines around it.

    c: str = "x"  # a comment after the code is not the description
    # --- second part ---
    d: bool = True
'''


def test_a_description_is_the_comment_lines_directly_above_the_field() -> None:
    (sample,) = read_source(SOURCE).values()
    assert sample.docstring == "What it is."
    found = {name: (f.section, f.comment) for name, f in sample.fields.items()}
    assert found == {
        "a": ("first part", "Two lines of comment."),
        "b": ("first part", ""),
        "c": ("first part", ""),
        "d": ("second part", ""),  # a section heading is no description
    }


def test_a_key_of_the_rules_choices_lists_them_and_null_where_null_is_allowed() -> None:
    table = rows(reference())
    assert set(CHOICES) <= set(table)
    for key, values in CHOICES.items():
        assert table[key][2] == ", ".join(f"`{v}`" for v in values), key
    assert set(NULL_MEANS) <= {key for key in CHOICES if table[key][1] == "`null`"}


def test_the_command_refuses_an_option_and_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"usage: python -m flodl.config.reference \[PATH\]"):
        main(["--check"])
    with pytest.raises(SystemExit, match=r"nowhere/ does not exist"):
        main([str(tmp_path / "nowhere" / "configuration.md")])
