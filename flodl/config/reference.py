"""The configuration reference, generated from the schema: `python -m flodl.config.reference [PATH]` writes
every key of flodl/config/schema.py (the groups' keys too) with its type, default, allowed values and the
comment above it to PATH (docs/configuration.md by default). tests/runs/test_config_reference.py fails when
the committed file is not what this writes.

Descriptions are the schema's own comments, read from its source: the comment lines directly above a field
(a `# --- name ---` line heads a section instead). Allowed values are the rules' own table of them
(`CHOICES` in flodl/config/rules/values.py), which the rules check each key's value against.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import sys
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from omegaconf import MISSING

from flodl.config import rules, schema

COMMAND = "python -m flodl.config.reference"
DEFAULT_PATH = Path("docs/configuration.md")
_HEADING = re.compile(r"^---\s*(.*?)\s*---$")


@dataclass(frozen=True)
class SourceField:
    """A dataclass field as the source writes it: the section it sits in and the comment above it."""

    section: str | None
    comment: str


@dataclass(frozen=True)
class SourceClass:
    docstring: str
    fields: dict[str, SourceField]


@dataclass(frozen=True)
class Key:
    name: str  # dotted, as an override names it
    type: str
    default: str
    allowed: tuple[str, ...]
    description: str
    section: str | None


@dataclass(frozen=True)
class Group:
    prefix: str  # "" for the top-level keys, else "task." and the like
    docstring: str
    keys: list[Key]


def read_source(source: str) -> dict[str, SourceClass]:
    """Each class of `source`: its docstring, and per annotated field its section and comment."""
    comments = _full_line_comments(source)
    headings = {line: found[1] for line, text in comments.items() if (found := _HEADING.match(text))}
    classes = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                line = statement.lineno
                above = [at for at in headings if node.lineno < at < line]
                section = headings[max(above)] if above else None
                fields[statement.target.id] = SourceField(section, _comment_above(comments, headings, line))
        classes[node.name] = SourceClass(ast.get_docstring(node) or "", fields)
    return classes


def groups(
    config: type,
    classes: Mapping[str, SourceClass],
    allowed: Mapping[str, tuple[str, ...]],
    prefix: str = "",
) -> list[Group]:
    """The keys of dataclass `config`, then those of each dataclass it holds (a group), depth first."""
    source = classes[config.__name__]
    hints = get_type_hints(config)
    keys, nested = [], []
    for field in dataclasses.fields(config):
        kind = hints[field.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            nested += groups(kind, classes, allowed, f"{prefix}{field.name}.")
            continue
        name = prefix + field.name
        written = source.fields[field.name]
        keys.append(
            Key(
                name,
                str(field.type),
                _default(field),
                allowed.get(name, ()),
                written.comment,
                written.section,
            )
        )
    return [Group(prefix, source.docstring, keys), *nested]


def render(all_groups: list[Group]) -> str:
    """The reference as markdown: one table per group, the top-level keys' split by their sections."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Written by `{COMMAND}` from flodl/config/schema.py: edit the schema (its",
        "comments are the descriptions), then run it; tests/runs/test_config_reference.py checks this file.",
        "-->",
        "",
        "Every key is an override on the command line (`python train.py epochs=5 launch.nproc_per_node=2`)",
        "and a key of the configs in `conf/`. *required*: the task's config sets it. The allowed values",
        "are the ones checked before any rank starts (`flodl/config/rules/values.py`; the other rules are",
        "beside it).",
    ]
    for group in all_groups:
        lines += ["", f"## `{group.prefix}*`" if group.prefix else "## Top-level keys"]
        if group.docstring:
            lines += ["", group.docstring]
        section: str | None = None
        for index, key in enumerate(group.keys):
            if index == 0 or key.section != section:
                section = key.section
                lines += [""] + ([f"### {section}", ""] if section else [])
                lines += [
                    "| key | type | default | allowed | description |",
                    "| --- | --- | --- | --- | --- |",
                ]
            allowed = ", ".join(f"`{value}`" for value in key.allowed)
            cells = [f"`{key.name}`", f"`{key.type}`", key.default, allowed, key.description]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def reference() -> str:
    """The reference of flodl's schema, as the command writes it."""
    classes = read_source(Path(schema.__file__).read_text())
    return render(groups(schema.FlodlConfig, classes, rules.CHOICES))


def _full_line_comments(source: str) -> dict[int, str]:
    """Line number -> text of each comment that is alone on its line (without its `#`)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.line.lstrip().startswith("#"):
            found[token.start[0]] = token.string.removeprefix("#").strip()
    return found


def _comment_above(comments: Mapping[int, str], headings: Mapping[int, str], line: int) -> str:
    """The comment lines directly above `line` (up to a blank line, code or a section heading), as one."""
    above = []
    line -= 1
    while line in comments and line not in headings:
        above.append(comments[line])
        line -= 1
    return " ".join(reversed(above))


def _default(field: dataclasses.Field) -> str:
    factory = field.default_factory
    value = factory() if callable(factory) else field.default  # MISSING when there is no factory
    return "*required*" if value == MISSING else f"`{_yaml(value)}`"


def _yaml(value: Any) -> str:
    """`value` as an override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    return str(value) if value != "" else '""'


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or any(arg.startswith("-") for arg in args):
        sys.exit(f"usage: {COMMAND} [PATH]  (PATH: {DEFAULT_PATH} by default)")
    path = Path(args[0]) if args else DEFAULT_PATH
    if not path.parent.is_dir():
        sys.exit(
            f"flodl: {path.parent}/ does not exist: run {COMMAND} in the checkout's root, or name a PATH"
        )
    path.write_text(reference())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
