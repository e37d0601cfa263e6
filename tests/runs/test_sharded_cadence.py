"""Cadence across sharded groups (docs/sharded-groups.md): 4 gloo ranks as 2 groups of 2, each group one
data-parallel replica sharded in two (FSDP2 inside it), each rank averaging its shard with the same shard of
the other group every window, end where plain torch's periodic averaging of the full model does."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation
from flodl.rounds.split import proportional_split
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

WORLD, K, BATCH, WINDOW, EPOCHS, LR, SEED = 4, 2, 8, 5, 2, 0.1, 42


def periodic_averaging(outer: str, overlap: bool = False) -> dict[str, torch.Tensor]:
    """Plain torch: one replica per group, each step SGD on the union of its members' micro-batches (the
    mean of their gradients, as the group's reduce-scatter makes it), the replicas' parameters averaged
    after every window, weighted by their steps (gamma=1); an `outer` optimizer steps the global model on
    the pseudo-gradient `global - average` (SGD, momentum 0.9: DiLoCo's Nesterov at lr 0.7, SlowMo's heavy
    ball at lr 1), and every replica takes the new global. Each rank is handed WINDOW batches a window, in
    rank order from one cursor over the epoch (whole groups of batches), the epoch's tail split in
    proportion to the counts. `overlap`: each round but the run's last lands one window late, at the end of
    the window trained while it was in flight, keeping what each replica trained since its snapshot
    (`θ += consensus - snapshot`), before the next round's snapshot."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    start = DigitsMLP(hidden=128)
    replicas = [copy.deepcopy(start) for _ in range(WORLD // K)]
    optimizers = [torch.optim.SGD(r.parameters(), lr=LR) for r in replicas]
    global_model = copy.deepcopy(start)
    lr, nesterov = {"diloco": (0.7, True), "slowmo": (1.0, False)}.get(outer, (0.0, False))
    outer_step = torch.optim.SGD(global_model.parameters(), lr=lr, momentum=0.9, nesterov=nesterov)
    batches = len(data) // BATCH // K * K
    in_flight: tuple[list[list[torch.Tensor]], list[torch.Tensor]] | None = None  # snapshots, consensus
    for epoch in range(EPOCHS):
        perm = epoch_permutation(len(data), SEED, epoch)
        cursor = 0
        while cursor < batches:
            counts = [WINDOW] * WORLD
            if sum(counts) >= batches - cursor:
                counts = proportional_split(batches - cursor, counts)
            firsts = [cursor + sum(counts[:r]) for r in range(WORLD)]
            steps = [counts[g * K] for g in range(len(replicas))]
            for g, (model, optimizer) in enumerate(zip(replicas, optimizers, strict=True)):
                members = range(g * K, (g + 1) * K)
                assert {counts[r] for r in members} == {steps[g]}  # a group's members step together
                for j in range(steps[g]):
                    batch = [perm[(firsts[r] + j) * BATCH : (firsts[r] + j + 1) * BATCH] for r in members]
                    inputs, labels = data.get_batch(torch.cat(batch))
                    optimizer.zero_grad()
                    F.cross_entropy(model(inputs), labels).backward()
                    optimizer.step()
            with torch.no_grad():
                if in_flight is not None:  # the round in flight lands now, keeping what came since it
                    snapshots, consensus = in_flight
                    for replica, snapshot in zip(replicas, snapshots, strict=True):
                        for p, s, c in zip(replica.parameters(), snapshot, consensus, strict=True):
                            p.add_(c - s)
                replica_params = zip(*(r.parameters() for r in replicas), strict=True)
                means = [
                    sum(p * (n / sum(steps)) for p, n in zip(ps, steps, strict=True)) for ps in replica_params
                ]
                if outer != "avg":
                    for gp, mean in zip(global_model.parameters(), means, strict=True):
                        gp.grad = gp - mean
                    outer_step.step()
                    means = [gp.detach() for gp in global_model.parameters()]
                cursor += sum(counts)
                if overlap and (epoch, cursor) != (EPOCHS - 1, batches):
                    in_flight = ([[p.clone() for p in r.parameters()] for r in replicas], means)
                    continue
                for replica in replicas:
                    for p, mean in zip(replica.parameters(), means, strict=True):
                        p.copy_(mean)
    return {k: v.detach() for k, v in replicas[0].state_dict().items()}


# 4 CPU ranks as 2 groups of 2 under cadence, started fast: what both runs here share.
GROUPS_OF_TWO = (
    f"launch.nproc_per_node={WORLD}",
    FAST_START,
    "device=cpu",
    "policy=cadence",
    f"shard_group={K}",
)
# A run compared with torch's periodic averaging: the window pinned at WINDOW, SGD at LR, no guard.
AGAINST_TORCH = (
    f"anchor={WINDOW}",
    f"min_anchor={WINDOW}",
    f"max_anchor={WINDOW}",
    "max_batch_diff=0",
    "divergence_guard=none",
    f"batch_size={BATCH}",
    f"epochs={EPOCHS}",
    "eval_every=1",
    f"seed={SEED}",
    "lr_scale_ratio=0",
    "task.optimizer._target_=torch.optim.SGD",
    f"task.optimizer.lr={LR}",
    "checkpoint_every=null",
    "hydra.run.dir=run",
)


@pytest.mark.parametrize("outer", ["avg", "diloco", "slowmo"])
def test_two_groups_of_two_average_their_shards_as_torch_averages_replicas(
    tmp_path: Path, outer: str
) -> None:
    train(*GROUPS_OF_TWO, *AGAINST_TORCH, f"outer={outer}", cwd=tmp_path, timeout=300).check()
    run = tmp_path / "run"
    whole = sum(p.numel() for p in DigitsMLP(hidden=128).parameters())
    for rank in range(WORLD):
        line = (
            f"rank {rank}: shard {rank % K} of group {rank // K} (FSDP2 in the group, rounds per shard index "
            f"over 2 group(s) of 2 rank(s): [0, 1] [2, 3]): {whole // K:,} of the model's {whole:,}"
        )
        assert line in (run / f"rank{rank}.log").read_text()
    per_epoch = 1438 // BATCH // K * K
    for epoch, record in enumerate(epochs_of(run)):  # every batch of the epoch's whole groups once
        batches = {p["rank"]: p["batches"] for p in record["per_rank"]}
        assert sum(batches.values()) == per_epoch
        assert batches[0] == batches[1] and batches[2] == batches[3]  # a group's members alike
        # Each epoch's eval counts every rank's steps (a shard's round stands for its group's ranks).
        assert record["eval_step"] == per_epoch * (epoch + 1)
    saved = torch.load(run / "model.pt", weights_only=True)
    for name, want in periodic_averaging(outer).items():
        assert ((saved[name] - want).norm() / want.norm()).item() <= 1e-5, name


def test_elche_paces_each_group_at_its_slowest_member_with_every_batch_once(tmp_path: Path) -> None:
    # ElChe free (its default anchor and growth, the divergence guard on), rank 1 slowed 3x: its group marches
    # at its pace, the other group's members at theirs, a group's members always handed as many batches (a
    # member short of its peers would hang the group's collectives: the run would not end).
    train(
        *GROUPS_OF_TWO,
        "simulate.slow_rank=1",
        "simulate.factor=3",
        f"batch_size={BATCH}",
        "epochs=4",
        "eval_every=0",
        "checkpoint_every=null",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=300,
    ).check()
    records = epochs_of(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(4))
    shares = [0, 0]
    for record in records:
        batches = {p["rank"]: p["batches"] for p in record["per_rank"]}
        assert sum(batches.values()) == 1438 // BATCH // K * K
        assert batches[0] == batches[1] and batches[2] == batches[3]
        shares = [shares[0] + batches[0], shares[1] + batches[2]]
    assert shares[0] < shares[1]  # the slowed member's group trained less


def test_overlapped_rounds_land_each_shard_one_window_late_as_torch_lands_replicas(tmp_path: Path) -> None:
    # backend=cpu: each round per shard index runs on the host averager's thread over the gloo group of its
    # shard index while the next window trains, and lands at that window's end (a group's members alike).
    # Refused before ("a round per shard index runs inline"): exit 2.
    train(
        *GROUPS_OF_TWO, *AGAINST_TORCH, "backend=cpu", "overlap_rounds=true", cwd=tmp_path, timeout=300
    ).check()
    run = tmp_path / "run"
    records = epochs_of(run)
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    during = [0] * WORLD
    for record in records:
        batches = {p["rank"]: p["batches"] for p in record["per_rank"]}
        assert sum(batches.values()) == 1438 // BATCH // K * K  # every batch of the epoch's whole groups once
        assert batches[0] == batches[1] and batches[2] == batches[3]  # a group's members alike
        assert "eval/accuracy" in record  # on the consensus of a round after the epoch's last batch
        for p in record["per_rank"]:
            during[p["rank"]] += p["steps_during_averaging"]
    assert all(n > 0 for n in during), during  # each trained the next window while a round was in flight
    assert during[0] == during[1] and during[2] == during[3], during  # and adopted it at the window's end
    saved = torch.load(run / "model.pt", weights_only=True)
    inline = periodic_averaging("avg")
    for name, want in periodic_averaging("avg", overlap=True).items():
        assert ((saved[name] - want).norm() / want.norm()).item() <= 1e-5, name
        assert ((saved[name] - inline[name]).norm() / want.norm()).item() > 1e-4, name  # not the inline math
