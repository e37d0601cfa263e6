"""Survive by groups' runs (docs/sharded-groups.md#survive-by-groups): 4 CPU ranks of digits as 2 groups of 2
under fault_tolerance=survive, and the invariants every such run keeps when a rank dies (its group leaves in
one change and comes back whole, every sample of every epoch once, one state per shard index)."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from flodl.checkpoints.sharded import SHARDED_DIR, optimizer_key, save_of, saved_groups, saved_keys
from flodl.tasks.digits import DigitsMLP
from tests.helpers.chaos_job import (
    EPOCHS,
    Job,
    Sample,
    Trial,
    check_each_sample_once,
    check_no_partial,
    read_samples,
    window_of_the_dead,
)
from tests.helpers.procs import Result
from tests.helpers.runs import epochs_of
from tests.helpers.survive_runs import STOP_ONCE_ADMITTED, digests, membership

WORLD, K = 4, 2
# Digits on 4 ranks: 11 steps of 32 samples each an epoch per rank; a kill within the first half of the run.
RANK_STEPS = 11
BATCH = 32  # digits' batch_size
EVERY_EPOCH = ("checkpoint_every=1", "checkpoint_keep=100")  # every checkpoint kept, each checked


def groups_of_two(job: Job, *overrides: str, until_admitted: bool = False, policy: str = "cadence") -> None:
    job.configure(
        f"policy={policy}",
        "fault_tolerance=survive",
        f"shard_group={K}",
        "device=cpu",
        "checkpoint_every=null",
        *overrides,
        until_admitted=until_admitted,
    )
    job.args = [f"launch.nproc_per_node={WORLD}" if a == "launch.nproc_per_node=2" else a for a in job.args]


def check_left_and_back_whole(
    job: Job, trial: Trial, result: Result, victim: int, restarts: int
) -> Counter[int]:
    """The run ended, its group left in one change (and came back whole, with `restarts`), every sample of
    every epoch trained once, the members ending with one state per shard index; the samples per epoch the
    dead group trained and never reported (lost with it)."""
    mate = _mate(victim)
    assert result.ok, (result.out + result.err)[-3000:]
    epochs = [r["epoch"] for r in epochs_of(job.run_dir)]
    assert epochs == list(range(len(epochs) if restarts else EPOCHS))
    check_no_partial(trial, job)

    # The group left in one change: the dead rank cut (its supervisor said it died), or its other rank,
    # whose collective with the dead one failed first, and the group with it.
    changes = membership(job.run_dir)
    cuts = [e for e in changes if e["event"] == "rank_cut"]
    others = sorted({0, 1, 2, 3} - {victim, mate})
    assert [(e["rank"] in (victim, mate), e["members"]) for e in cuts] == [(True, others)], cuts
    assert f"its group {sorted([victim, mate])} leaves with it" in cuts[0]["why"]

    logs = logs_of(job.run_dir) + (job.run_dir / "coordinator.log").read_text()
    final = digests(logs, "final round")
    if restarts:
        # Back whole, in one admission: each restarted rank took its shard (parameters and the optimizer's
        # moments) from the member holding its shard index, and every group ends with one state.
        admitted = [e for e in changes if e["event"] == "rank_admitted"]
        assert [(e["rank"] in (victim, mate), e["members"]) for e in admitted] == [(True, [0, 1, 2, 3])]
        assert f"its group {sorted([victim, mate])} with it" in admitted[0]["why"]
        assert admitted[0]["first_round_s"] is not None, admitted  # done, not overtaken
        shared = dict(re.findall(r"rank (\d+): state after admitting \[\d+, \d+\]: (.+)", logs))
        assert sorted(shared) == ["0", "1", "2", "3"], shared
        # The members of the group left shared at one step (a joiner takes its sharer's): the group admitted
        # holds one model, its shards of one moment.
        assert len({re.findall(r", step (\d+),", line)[0] for line in shared.values()}) == 1, shared
        for rank in range(K):  # its shard index's two ranks, one per group
            assert shared[str(rank)] == shared[str(rank + K)], shared
        assert sorted(final) == [0, 1, 2, 3], final
        assert final[0] == final[2] and final[1] == final[3], final
    else:  # the group that left says no final state
        assert sorted(final) == others, final
    # The whole model, gathered by a group, written by the first member.
    model = torch.load(job.run_dir / "model.pt", weights_only=True)
    whole = DigitsMLP(hidden=128).state_dict()
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in whole.items()}

    samples = read_samples(job.log_dir)
    window = window_of_the_group(job, trial, samples, victim)
    # Steps the dead rank trained with its group and died before reporting: lost, not in the record.
    lost: Counter[int] = Counter()
    for batches, shown in re.findall(r"(\d+) batch\(es\) of epoch (\d+) trained and not reported", logs):
        lost[int(shown) - 1] += int(batches) * BATCH
    check_each_sample_once(trial, job, samples, window, may_lose=True, unreported=lost)
    assert trial.violations == [], (trial.plan, trial.violations)
    return lost


def logs_of(run: Path) -> str:
    return "".join((run / f"rank{r}.log").read_text() for r in range(WORLD))


def groups_in(checkpoints: Path, key: Callable[[int], str] = optimizer_key) -> dict[str, tuple[int, ...]]:
    """Each committed checkpoint's groups in (of its manifest's ranks), checked to have their own optimizer
    states in its shards, each under its key (`key`: what a group's own save holds; DiLoCo's inner state is
    empty at a round, its outer momentum not) (a group that died once its save was written, before its
    parts, leaves its save too: its state at that round)."""
    found = {}
    for manifest in sorted(checkpoints.glob("*/manifest.json")):
        inside = tuple(sorted({r // K for r in json.loads(manifest.read_text())["ranks"]}))
        sharded = manifest.parent / SHARDED_DIR
        for group in inside:
            assert key(group) in saved_keys(save_of(sharded, group)), (manifest.parent, group)
        assert set(inside) <= set(saved_groups(sharded) or ()), (manifest.parent, inside)
        found[manifest.parent.name] = inside
    return found


def resume_and_check(job: Job, trial: Trial, victim: int, restarts: int) -> None:
    """Every checkpoint held the groups in at it, the last one those left at the end; resumed on the same
    layout for 2 epochs more, every sample of them trained once, on both groups."""
    held = groups_in(job.run_dir / "checkpoints")
    last = held[max(held)]
    assert last == ((0, 1) if restarts else (1 - victim // K,)), (trial.plan, held)

    first = len(epochs_of(job.run_dir))
    args = [a for a in job.args if a != STOP_ONCE_ADMITTED and not a.startswith("epochs=")]
    result = job.finish(job.start([*args, f"epochs={first + 2}", "resume=auto"]), trial)
    assert result.ok, (trial.plan, (result.out + result.err)[-3000:])
    records = epochs_of(job.run_dir)
    assert [r["epoch"] for r in records] == list(range(first + 2)), (trial.plan, records)
    trained: dict[int, Counter[int]] = defaultdict(Counter)
    for sample in read_samples(job.log_dir):
        if sample.start == 1:
            trained[sample.epoch].update(sample.ids)
    assert sorted(trained) == [first, first + 1], (trial.plan, sorted(trained))
    for epoch, ids in trained.items():
        assert set(ids.values()) == {1} and len(ids) == records[epoch]["samples"], (trial.plan, epoch)
    if last != (0, 1):  # the group out at the checkpoint took the state of the group in
        out = victim // K
        assert f"group {out} takes saved group {1 - out}'s" in logs_of(job.run_dir), trial.plan
    resumed = groups_in(job.run_dir / "checkpoints")
    assert resumed[max(resumed)] == (0, 1), (trial.plan, resumed)


def _mate(rank: int) -> int:
    return rank + 1 if rank % K == 0 else rank - 1


def window_of_the_group(job: Job, trial: Trial, samples: list[Sample], victim: int) -> set[Sample]:
    """The steps of the dead rank's first processes and its other's past the last round that averaged them
    (chaos_job.window_of_the_dead; the group was cut with the first of them the coordinator cut)."""
    cut = next(e["rank"] for e in membership(job.run_dir) if e["event"] == "rank_cut")
    window: set[Sample] = set()
    for rank in (victim, _mate(victim)):
        pid = int(job.files(rank)[0].stem.rsplit("-", 1)[1])
        window |= window_of_the_dead(trial, job, samples, rank, pid, cut_with=cut)
    return window
