"""A sharded model's rounds (shard_group=k > 1): each rank averages its local shards, those of its group's
FSDP2 parameters (DTensors: `to_local()`), with the same shard of every other group (`ShardSharers`, the
averager's group, one per shard index).

FSDP2 keeps each shard in storage of its own (padded for its all-gather), which a flat buffer cannot take the
place of, as it does a replica's parameters (flat.py): the flat buffers here hold copies of the shards, taken
before what a round reads (`pull`) and put back after what it writes (`push`). A round's copy out and in is
the shard's size once each way, 1/k of the model. A forward without a backward (an eval) leaves a unit
gathered (FSDP2 keeps the root's parameters gathered after its forward), and a gathered unit computes with
its gathered copy, not its shards: `push` lets go of it, so the next forward gathers what the round wrote
(an async rank's blend, written after the eval of the consensus).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:  # imported where a model is sharded: it takes about a second (sharding/fsdp.py)
    from torch.distributed.fsdp import FSDPModule

from flodl.averaging.flat import by_dtype, flat_copies
from flodl.averaging.reduce_group import WorldGroup


class Sharded(Protocol):
    """A sharded parameter (FSDP2's DTensor): the rank's shard of it."""

    def to_local(self) -> Tensor: ...


def sharded_parameters(model: nn.Module) -> list[Sharded]:
    """The trainable parameters of a model sharded with FSDP2 (DTensors)."""
    params = [cast("Sharded", p) for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return params


def gathered_units(model: nn.Module) -> list[FSDPModule]:
    """The units FSDP2 gathers for a forward (the model's sharded modules, the root among them)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class ShardCopies:
    """The rank's local shards of `sharded`, copied into one flat buffer per dtype; `units`: the modules
    that gather them (let go of after a push)."""

    def __init__(self, sharded: list[Sharded], units: list[FSDPModule] | None = None) -> None:
        self.sharded = sharded
        self.units = units or []
        self.groups = flat_copies(self._local())

    def _local(self) -> list[Tensor]:
        """The local shards now. Asked afresh each time: FSDP2 puts a shard of uneven rows into padded
        storage of its own at the first forward (the tensor changes)."""
        return [p.to_local() for p in self.sharded]

    @torch.no_grad()
    def pull(self) -> None:
        """The shards as they are now into the flat buffers (before a round reads them)."""
        for group, tensors in zip(self.groups, by_dtype(self._local()), strict=True):
            torch._foreach_copy_(group.views, tensors)

    @torch.no_grad()
    def push(self) -> None:
        """The flat buffers back into the shards (after a round wrote them); a unit still gathered lets go
        of its gathered copy, so its next forward computes with them."""
        for group, tensors in zip(self.groups, by_dtype(self._local()), strict=True):
            torch._foreach_copy_(tensors, group.views)
        for unit in self.units:
            unit.reshard()


class ShardSharers(WorldGroup):
    """The ranks holding one shard index, one in each sharded group (fault_tolerance=none): their process
    group, built once by the assembly from the job's groups; every member starts from the first group's
    shard."""

    def __init__(self, process_group: dist.ProcessGroup, first: int, timeout_s: float = 1800.0) -> None:
        """`first`: the rank of the first group that holds this shard (its global rank)."""
        super().__init__(process_group, timeout_s)
        self.first = first

    def share_before_start(self, tensors: list[Tensor]) -> None:
        for tensor in tensors:
            dist.broadcast(tensor, src=self.first, group=self.process_group)
