"""Rank side of tests/runs/test_sharded_wire.py: 4 spawned gloo ranks as 2 groups of 2, a small model sharded
with FSDP2 in each group, rounds of the device averager over a delta wire per shard index.

Each round, each group's model moves by a change drawn from (group, round, parameter), the same on the
group's two ranks (each adds its rows, laid out by torch's `distribute_tensor`); then one round, and every
rank saves the full model (gathered in its group). One spawn runs every wire in turn, each on a fresh model
and averager (4 spawned ranks' start is most of the test's time). The parent computes the same rounds on
the full models; nothing here asserts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor

from flodl.averaging.consensus import DeviceAverager
from flodl.averaging.shards import ShardSharers
from flodl.averaging.wire import WIRES
from flodl.sharding.fsdp import group_mesh, shard_model
from flodl.sharding.groups import ShardGroups
from tests.helpers.spawned import join_group, leave

WORLD, K, ROUNDS, GAMMA = 4, 2, 4, 1.0
# Each group's steps in the first round (one more each round after).
STEPS = (3, 1)


def make_model() -> nn.Sequential:
    """Shards of 6302 and 6001 elements (the head's 3 rows cut 2 + 1): blocks of 512 cross parameters, and
    a shard's blocks are not the whole model's."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 300), nn.Tanh(), nn.Linear(300, 3))


def change(group: int, round_: int, index: int, shape: torch.Size) -> torch.Tensor:
    """What group `group` trains into parameter `index` before round `round_` (the same on its ranks)."""
    generator = torch.Generator().manual_seed(1000 * group + 100 * round_ + index)
    return torch.randn(shape, generator=generator) * 0.01 * (index + 1)


def worker(rank: int, port: int, out_dir: str, wires: tuple[str, ...]) -> None:
    """One spawned rank (torch.multiprocessing.start_processes passes the index first): each of `wires`'
    rounds, saved by the wire's name."""
    join_group(rank, port, WORLD, out_dir)
    shards = ShardGroups(WORLD, K)
    mesh = group_mesh(shards, "cpu")
    sharers = ShardSharers(mesh.get_group("replicate"), shards.sharers(shards.shard_index(rank))[0])
    leave({wire: wire_rounds(shards.group_of(rank), mesh, sharers, wire) for wire in wires}, rank, out_dir)


def wire_rounds(group: int, mesh: DeviceMesh, sharers: ShardSharers, wire: str) -> dict:
    """A fresh model's ROUNDS rounds over `wire`: each round's full model, the feedback, what a checkpoint's
    feedback resumes to."""
    model = make_model()
    shard_model(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh["shard"])
    averager = DeviceAverager(
        model, GAMMA, torch.device("cpu"), WIRES[wire], keeps_own=False, group=sharers, shard_group=K
    )
    rounds = []
    for round_ in range(ROUNDS):
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                moved = distribute_tensor(change(group, round_, i, p.shape), p.device_mesh, p.placements)
                p.to_local().add_(moved.to_local())
        averager.begin(STEPS[group] + round_)
        averager.finish()
        averager.adopt(None, None)
        rounds.append([p.full_tensor() for p in model.parameters()])
    feedback = averager.state_dict()["wire_feedback"]
    return {"rounds": rounds, "feedback": feedback, "reloaded": reloaded(model, wire, sharers, feedback)}


def reloaded(model: nn.Module, wire: str, sharers: ShardSharers, feedback: dict) -> dict[str, dict]:
    """What a fresh averager keeps of a checkpoint's feedback: this shard's own, and the other shard's (a part
    of other groups): collective, the ranks holding a shard start each fresh averager together."""
    if not feedback:  # bf16 keeps none
        return {}
    whole = sum(p.numel() for p in make_model().parameters())
    other = {0: torch.ones(whole - feedback[0].numel())}
    kept = {}
    for name, saved in (("own", feedback), ("other", other)):
        fresh = DeviceAverager(
            model, GAMMA, torch.device("cpu"), WIRES[wire], keeps_own=False, group=sharers, shard_group=K
        )
        fresh.load_state_dict({"wire_feedback": saved})
        kept[name] = fresh.state_dict()["wire_feedback"]
    return kept
