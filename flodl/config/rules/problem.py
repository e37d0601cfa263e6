"""How a rule names what it refuses, and how it reads a dotted key."""

from __future__ import annotations

from dataclasses import fields

from flodl.config.schema import FlodlConfig


def problem(key: str, value: object, rule: str) -> str:
    return f"{key}={value!r}: {rule}"


def value_at(cfg: FlodlConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def schema_defaults() -> dict[str, object]:
    """The top-level keys' defaults, as the schema declares them."""
    return {f.name: f.default for f in fields(FlodlConfig)}
