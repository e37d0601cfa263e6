"""Samples and batches of any structure: tensors, numbers and strings in nested lists, tuples and dicts.

`flatten` splits a sample into a JSON-able tree spec and its tensor leaves, `unflatten` puts it back with
the same types and values: the disk pack stores the spec as text and the tensors as raw bytes (no pickle).
`to_device` moves every tensor of a batch to the device (and objects that move themselves, with `to`) and
leaves numbers and strings as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

# Values a batch may carry besides tensors: they stay on the host, untouched.
PLAIN = (bool, int, float, complex, str, bytes, type(None))
# Leaf values the pack's tree spec holds as JSON.
_JSON = (bool, int, float, str, type(None))


def flatten(sample: Any) -> tuple[Any, list[Tensor]]:
    """(tree spec, tensor leaves) of a sample; TypeError names what a record cannot hold."""
    leaves: list[Tensor] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, Tensor):
            leaves.append(node)
            return {"t": len(leaves) - 1}
        if isinstance(node, np.ndarray):
            leaves.append(torch.from_numpy(np.ascontiguousarray(node)))
            return {"n": len(leaves) - 1}
        if isinstance(node, _JSON):
            return {"v": node}
        if type(node) is dict:
            if not all(isinstance(k, (str, int)) for k in node):
                raise TypeError(f"sample{path}: dict keys must be str or int to be staged on disk")
            return {"d": [[k, walk(v, f"{path}[{k!r}]")] for k, v in node.items()]}
        if type(node) in (list, tuple):
            kind = "l" if type(node) is list else "u"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        raise TypeError(
            f"sample{path}: a {type(node).__module__}.{type(node).__qualname__} cannot be staged on disk "
            "(records hold tensors, numbers and strings in lists, tuples and dicts)"
        )

    return walk(sample, ""), leaves


def unflatten(spec: Any, leaves: list[Tensor]) -> Any:
    if "t" in spec:
        return leaves[spec["t"]]
    if "n" in spec:
        return leaves[spec["n"]].numpy()
    if "v" in spec:
        return spec["v"]
    if "d" in spec:
        return {k: unflatten(v, leaves) for k, v in spec["d"]}
    if "l" in spec:
        return [unflatten(v, leaves) for v in spec["l"]]
    return tuple(unflatten(v, leaves) for v in spec["u"])


def nbytes(sample: Any) -> int:
    """The bytes of a sample's tensors."""
    if isinstance(sample, list) and all(isinstance(t, Tensor) for t in sample):  # a BatchDataSet's rows
        return sum(t.numel() * t.element_size() for t in sample)
    return sum(t.numel() * t.element_size() for t in tree_leaves(sample) if isinstance(t, Tensor))


def owned(sample: Any) -> Any:
    """The sample with every tensor copied (a cached sample must not pin its source's storage)."""
    return tree_map_only(Tensor, torch.clone, sample)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor moved; an object with its own `to` (a tokenizer's BatchEncoding, say) moves itself."""

    def move(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return leaf.to(device, non_blocking=non_blocking)
        return leaf if isinstance(leaf, PLAIN) else leaf.to(device)

    return tree_map(move, batch)


def describe(node: Any) -> str:
    """The structure of a sample or batch, e.g. `dict{x: Tensor(float32, [8]), y: int}`."""
    if isinstance(node, Tensor):
        return f"Tensor({str(node.dtype).removeprefix('torch.')}, {list(node.shape)})"
    if isinstance(node, dict):
        return f"{type(node).__name__}{{" + ", ".join(f"{k}: {describe(v)}" for k, v in node.items()) + "}"
    if isinstance(node, (list, tuple)):
        inner = [describe(v) for v in node[:4]] + (["..."] if len(node) > 4 else [])
        return f"{type(node).__name__}[" + ", ".join(inner) + "]"
    kind = type(node)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_movable(batch: Any, what: str) -> None:
    """Raise naming the first value of `batch` that is neither a tensor nor a plain value (checked once, on
    the first batch: the device move would pass it to the loss unmoved)."""
    for leaf in tree_leaves(batch):
        if not isinstance(leaf, (Tensor, *PLAIN)) and not callable(getattr(leaf, "to", None)):
            raise TypeError(
                f"{what}: a batch holds a {describe(leaf)}, which cannot be moved to a device (batch: "
                f"{describe(batch)}); return tensors, numbers or strings from __getitem__ (e.g. "
                "torchvision.transforms.ToTensor) or convert it in task.collate_fn"
            )


def same(a: Any, b: Any) -> bool:
    """Whether two samples have the same structure, values and tensor bytes."""
    (spec_a, leaves_a), (spec_b, leaves_b) = flatten(a), flatten(b)
    return spec_a == spec_b and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )
