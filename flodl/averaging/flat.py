"""Parameters and float32 buffers as views into one contiguous buffer per dtype.

A local-SGD reduce is then one collective per dtype on memory the model already uses: no gather
before, no scatter after. Re-pointing keeps each nn.Parameter object (only its storage moves), so an
optimizer built before or after sees the same parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class FlatGroup:
    buffer: Tensor
    views: list[Tensor]


def _group_by_dtype(tensors: Iterable[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _flatten(tensors: list[Tensor], repoint: Callable[[Tensor, Tensor], None]) -> FlatGroup:
    total = sum(t.numel() for t in tensors)
    buffer = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    views, offset = [], 0
    for t in tensors:
        view = buffer[offset : offset + t.numel()].view_as(t)
        view.copy_(t.detach())
        repoint(t, view)
        views.append(view)
        offset += t.numel()
    return FlatGroup(buffer, views)


@torch.no_grad()
def flat_copies(tensors: Iterable[Tensor]) -> list[FlatGroup]:
    """Copies of `tensors` in one flat buffer per dtype (`by_dtype`'s order); the tensors stay where they
    are."""
    return [_flatten(group, lambda tensor, view: None) for group in by_dtype(tensors)]


def by_dtype(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """`tensors` by dtype, in the order each dtype first comes, each in its own order."""
    return list(_group_by_dtype(tensors).values())


@torch.no_grad()
def flatten_parameters(model: nn.Module) -> list[FlatGroup]:
    """Re-point every trainable parameter into a flat buffer per dtype."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")

    def repoint(param: Tensor, view: Tensor) -> None:
        param.data = view

    return [_flatten(group, repoint) for group in _group_by_dtype(params).values()]


def state_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str, Tensor]]:
    """The buffers that are the model's state, those its state_dict saves: (qualified name, module, name,
    tensor). Those registered persistent=False are constants or a rank's own (float8's maxima seen,
    flodl/worker/float8.py): never averaged, broadcast or compared across ranks."""
    return [
        (f"{prefix}.{name}" if prefix else name, module, name, buf)
        for prefix, module in model.named_modules()
        for name, buf in module._buffers.items()
        if buf is not None and name not in module._non_persistent_buffers_set
    ]


def rank_own_buffers(model: nn.Module) -> list[str]:
    """The qualified names of the buffers `state_buffers` leaves out (DDP is told to leave them too)."""
    state = {qualified for qualified, *_ in state_buffers(model)}
    return [name for name, _ in model.named_buffers(remove_duplicate=False) if name not in state]


@torch.no_grad()
def flatten_float32_buffers(model: nn.Module) -> FlatGroup | None:
    """Re-point the float32 state buffers (e.g. BatchNorm statistics) into one flat buffer; None if none.

    Other buffers (integer counters, `rank_own_buffers`) stay where they are and are never averaged.
    """
    owned = [
        (module, name, buf) for _, module, name, buf in state_buffers(model) if buf.dtype == torch.float32
    ]
    if not owned:
        return None
    tensors = [buf for _, _, buf in owned]
    slots = {id(buf): (module, name) for module, name, buf in owned}

    def repoint(buf: Tensor, view: Tensor) -> None:
        module, name = slots[id(buf)]
        module._buffers[name] = view

    return _flatten(tensors, repoint)


def state_digest(tensors: Iterable[Tensor]) -> str:
    """A short fingerprint of `tensors`, bit for bit (one read-back each: said at membership changes and at
    the end, where members must hold the same state)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
