"""Async across sharded groups (docs/sharded-groups.md): 4 gloo ranks as 2 groups of 2, each group one
data-parallel replica sharded in two (FSDP2 inside it), each rank averaging its shard with the same shard of
the other group and blending the consensus in (EASGD), end where plain torch's blended averaging of the full
model does; with ElChe free and the overshoot on, a group's members step together and every batch is
trained once."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation
from flodl.rounds.split import balanced_split
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import FAST_START, held_rounds_env, train
from tests.helpers.runs import epochs_of, round_steps

pytestmark = pytest.mark.multiproc

WORLD, K, BATCH, WINDOW, EPOCHS, LR, ALPHA, SEED = 4, 2, 8, 5, 2, 0.1, 0.5, 42
PER_EPOCH = 1438 // BATCH // K * K  # the digits' batches an epoch, whole groups of them

GROUPS_OF_TWO = (
    f"launch.nproc_per_node={WORLD}",
    FAST_START,
    "device=cpu",
    "policy=async",
    f"shard_group={K}",
    f"batch_size={BATCH}",
    "checkpoint_every=null",
    "hydra.run.dir=run",
)


def blended_averaging(alpha: float, outer: str = "avg") -> dict[str, torch.Tensor]:
    """Plain torch: one replica per group, each step SGD on the union of its members' micro-batches; after
    every window of WINDOW batches a rank, handed from one cursor across the epochs in rank order (the run's
    tail split so that every rank holds its share), the replicas' mean weighted by their steps, which each
    replica blends in, `θ += alpha (mean - θ)`; the last round adopts it. An `outer` optimizer first steps
    the global model on `global - mean` (DiLoCo: SGD with Nesterov momentum 0.9 at lr 0.7), and the replicas
    blend in (or adopt) the new global."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    start = DigitsMLP(hidden=128)
    replicas = [copy.deepcopy(start) for _ in range(WORLD // K)]
    optimizers = [torch.optim.SGD(r.parameters(), lr=LR) for r in replicas]
    global_model = copy.deepcopy(start)
    outer_step = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    perms = [epoch_permutation(len(data), SEED, epoch) for epoch in range(EPOCHS)]
    cursor, total = 0, EPOCHS * PER_EPOCH
    while cursor < total:
        counts = [WINDOW] * WORLD
        if sum(counts) > total - cursor:
            counts = balanced_split(total - cursor, counts, [0] * WORLD)
        firsts = [cursor + sum(counts[:r]) for r in range(WORLD)]
        cursor += sum(counts)
        steps = [counts[g * K] for g in range(len(replicas))]
        for g, (model, optimizer) in enumerate(zip(replicas, optimizers, strict=True)):
            members = range(g * K, (g + 1) * K)
            assert {counts[r] for r in members} == {steps[g]}  # a group's members step together
            for j in range(steps[g]):
                picks = []
                for r in members:  # batch b of the run: batch b % PER_EPOCH of epoch b // PER_EPOCH
                    epoch, b = divmod(firsts[r] + j, PER_EPOCH)
                    picks.append(perms[epoch][b * BATCH : (b + 1) * BATCH])
                inputs, labels = data.get_batch(torch.cat(picks))
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), labels).backward()
                optimizer.step()
        blend = alpha if cursor < total else None
        with torch.no_grad():
            pieces = list(zip(*(r.parameters() for r in replicas), strict=True))
            means = [sum(p * (n / sum(steps)) for p, n in zip(ps, steps, strict=True)) for ps in pieces]
            if outer != "avg":
                for gp, mean in zip(global_model.parameters(), means, strict=True):
                    gp.grad = gp - mean
                outer_step.step()
                means = [gp.detach() for gp in global_model.parameters()]
            for ps, mean in zip(pieces, means, strict=True):
                for p in ps:
                    p.copy_(mean if blend is None else p + blend * (mean - p))
    return {k: v.detach() for k, v in replicas[0].state_dict().items()}


@pytest.mark.parametrize("outer", ["avg", "diloco"])
def test_two_groups_of_two_blend_their_shards_as_torch_blends_replicas(tmp_path: Path, outer: str) -> None:
    pinned = (f"anchor={WINDOW}", f"min_anchor={WINDOW}", f"max_anchor={WINDOW}", "max_batch_diff=0")
    train(
        *GROUPS_OF_TWO,
        *pinned,
        "max_overshoot=0",  # a window is its count: the rounds fall where the reference's do
        f"easgd_alpha={ALPHA}",
        f"outer={outer}",
        "divergence_guard=none",
        f"epochs={EPOCHS}",
        "eval_every=1",
        f"seed={SEED}",
        "lr_scale_ratio=0",
        "task.optimizer._target_=torch.optim.SGD",
        f"task.optimizer.lr={LR}",
        cwd=tmp_path,
        timeout=300,
    ).check()
    run = tmp_path / "run"
    records = epochs_of(run)
    assert [r["epoch"] for r in records] == list(range(EPOCHS))
    for record in records:  # every batch of the epoch's whole groups once
        assert sum(p["batches"] for p in record["per_rank"]) == PER_EPOCH
    saved = torch.load(run / "model.pt", weights_only=True)
    want = blended_averaging(ALPHA, outer)
    for name, value in want.items():
        assert ((saved[name] - value).norm() / value.norm()).item() <= 1e-5, name


@pytest.mark.parametrize("seed", [0, 1])
def test_a_group_steps_together_past_its_count_with_every_batch_once(tmp_path: Path, seed: int) -> None:
    # ElChe free (its default anchor, growth and auto overshoot), a rank slowed (which and how much drawn from
    # the seed): each rank trains on past its count until the round's order reaches it, and a group's members
    # read it at their own moments; they must stop at the same step. A member a step ahead of its peer
    # (without the group's vote) gathers the peer's shard from after its round, and the round weighs the two
    # members' shards by different steps (or the group hangs).
    rng = random.Random(seed)
    slow, factor = rng.randrange(WORLD), rng.choice([2, 3, 4])
    train(
        *GROUPS_OF_TWO,
        f"simulate.slow_rank={slow}",
        f"simulate.factor={factor}",
        "epochs=4",
        "eval_every=0",
        cwd=tmp_path,
        timeout=300,
    ).check()
    records = epochs_of(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(4))
    totals = [0] * WORLD
    for record in records:
        assert sum(p["batches"] for p in record["per_rank"]) == PER_EPOCH
        for p in record["per_rank"]:
            totals[p["rank"]] += p["batches"]
    # A group's members trained alike over the run (a window's slices may straddle epochs differently).
    assert totals[0] == totals[1] and totals[2] == totals[3]
    assert totals[slow] < totals[(slow + K) % WORLD]  # the slowed member's group trained less
    for steps in round_steps(tmp_path / "run"):  # a round averages a group's members at one step
        assert steps[0] == steps[1] and steps[2] == steps[3], steps


@pytest.mark.parametrize("seed", [0, 1])
def test_a_group_trains_on_while_its_rounds_run_on_the_host_thread_and_adopts_at_one_step(
    tmp_path: Path, seed: int
) -> None:
    # backend=cpu: each round per shard index runs on the host averager's thread over its shard index's gloo
    # group, held back 0.2 s there (tests/helpers/slow_round) so that the ranks surely train on while it is in
    # flight; ElChe free with its overshoot, a rank slowed (which and how much drawn from the seed), an eval
    # every epoch. Each member's thread ends at its own moment: the members adopt at one step (their vote
    # before each step), so each trains as many steps while its rounds are in flight as its other does.
    # Before, the rounds ran inline: no step was trained during one.
    rng = random.Random(seed)
    slow, factor = rng.randrange(WORLD), rng.choice([2, 3])
    train(
        *GROUPS_OF_TWO,
        "backend=cpu",
        f"simulate.slow_rank={slow}",
        f"simulate.factor={factor}",
        "epochs=3",
        "eval_every=1",
        cwd=tmp_path,
        timeout=300,
        **held_rounds_env(0.2),
    ).check()
    records = epochs_of(tmp_path / "run")
    assert [r["epoch"] for r in records] == list(range(3))
    totals, during = [0] * WORLD, [0] * WORLD
    for record in records:
        assert sum(p["batches"] for p in record["per_rank"]) == PER_EPOCH  # every batch once
        assert "eval/accuracy" in record
        for p in record["per_rank"]:
            totals[p["rank"]] += p["batches"]
            during[p["rank"]] += p["steps_during_averaging"]
    assert totals[0] == totals[1] and totals[2] == totals[3], totals  # a group's members alike
    assert sum(during) > 0 and during[0] == during[1] and during[2] == during[3], during
    for steps in round_steps(tmp_path / "run"):  # a round averages a group's members at one step
        assert steps[0] == steps[1] and steps[2] == steps[3], steps
