"""A sharded model's rounds work on copies of the rank's shards (flodl/averaging/shards.py): read where each
shard is at the round, written back there, never aliased."""

from __future__ import annotations

import torch
from torch import Tensor

from flodl.averaging.shards import ShardCopies


class Shard:
    """A sharded parameter whose shard FSDP2 may move into storage of its own (as at its first forward, for
    a shard of uneven rows): the same values in another tensor."""

    def __init__(self, values: Tensor) -> None:
        self.local = values

    def to_local(self) -> Tensor:
        return self.local

    def move(self) -> None:
        self.local = self.local.clone()


def test_a_round_reads_and_writes_each_shard_where_it_is_now() -> None:
    a, b = Shard(torch.tensor([1.0, 2.0, 3.0])), Shard(torch.tensor([[4.0, 5.0]]))
    c = Shard(torch.tensor([7.0], dtype=torch.float64))
    copies = ShardCopies([a, b, c])
    assert [g.buffer.tolist() for g in copies.groups] == [[1, 2, 3, 4, 5], [7]]  # one buffer per dtype
    a.move()
    a.local.add_(10)  # trained in its new storage
    copies.pull()
    assert copies.groups[0].buffer.tolist() == [11, 12, 13, 4, 5]
    copies.groups[0].buffer.mul_(2)  # the round's consensus
    copies.groups[1].buffer.add_(1)
    a.move()
    copies.push()
    assert (a.local.tolist(), b.local.tolist(), c.local.tolist()) == ([22, 24, 26], [[8, 10]], [8])
    copies.groups[0].buffer.zero_()  # the copies are the round's own: the shards keep their values
    assert a.local.tolist() == [22, 24, 26]
