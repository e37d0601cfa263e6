"""Import the `_target_`s a config names before any rank starts, so a typo is one line, not N tracebacks."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any


def locate(path: str) -> object:
    """The object at dotted `path`: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only a missing prefix of the path itself means "try shorter"; a missing import inside a found
            # module is the user's error to see.
            if err.name is None or not (module_name + ".").startswith(err.name + "."):
                raise
            if cut == 1:
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"empty target {path!r}")


def target_problems(key: str, nodes: list[Any]) -> Iterator[str]:
    """One problem per entry of the list `key` that is no `_target_` config or whose target won't import."""
    for i, node in enumerate(nodes):
        where = f"{key}[{i}]"
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
            yield f"{where}={node!r}: must be a mapping with a _target_ (e.g. {{_target_: mypkg.MyCallback}})"
            continue
        target = node["_target_"]
        try:
            locate(target)
        except Exception as err:  # whatever importing the user's module raises
            yield f"{where}._target_={target!r}: cannot be imported ({type(err).__name__}: {err})"
