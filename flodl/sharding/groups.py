"""Which ranks form each sharded group, and which ranks hold the same shard; pure.

A job of `world_size` ranks with `shard_group=k` forms `world_size / k` groups of k consecutive ranks. Inside
a group each rank holds one shard of the model (its shard index: its place in the group); the ranks that share
a shard index, one in each group, hold the same shard (the replicate dimension of the device mesh: under
sync each step's gradients are all-reduced among them; local SGD will average each shard among them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The device mesh's dimensions, outer first: across groups, then inside one.
MESH_DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class ShardGroups:
    world_size: int
    # Ranks per group (shard_group).
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.world_size % self.size:
            raise ValueError(f"{self.size} ranks per group do not divide {self.world_size} ranks")

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded at all (1 rank per group: every rank a full replica)."""
        return self.size > 1

    @property
    def count(self) -> int:
        return self.world_size // self.size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The device mesh, (groups, ranks per group) as MESH_DIMS names them: row g is group g's ranks."""
        return (self.count, self.size)

    def members(self, group: int) -> list[int]:
        """The ranks of `group`, in shard index order."""
        return list(range(group * self.size, (group + 1) * self.size))

    def group_of(self, rank: int) -> int:
        return rank // self.size

    def shard_index(self, rank: int) -> int:
        return rank % self.size

    def sharers(self, index: int) -> list[int]:
        """The ranks holding shard `index`, one per group (the averaging group of that shard)."""
        return [group * self.size + index for group in range(self.count)]

    def words(self) -> str:
        """The groups as a line says them: '2 groups of 2 ranks: [0, 1] [2, 3]'."""
        shown = " ".join(str(self.members(g)) for g in range(min(self.count, 4)))
        more = f" ... [{self.world_size - self.size}..{self.world_size - 1}]" if self.count > 4 else ""
        return f"{self.count} group(s) of {self.size} rank(s): {shown}{more}"


def shard_numel(shape: Sequence[int], size: int) -> int:
    """Elements one rank holds of a tensor of `shape` sharded over `size` ranks as FSDP2 shards it: its
    first dimension cut into `size` pieces of ceil(dim / size) rows (the last padded), the rest whole."""
    if not shape:
        return 1  # a scalar is not cut (FSDP2 holds it whole on every rank)
    return math.ceil(shape[0] / size) * math.prod(shape[1:])
