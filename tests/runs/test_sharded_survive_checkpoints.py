"""Checkpoints of survive by groups (docs/sharded-groups.md#checkpoints): 4 CPU ranks as 2 groups of 2 under
cadence or async with fault_tolerance=survive and a checkpoint every epoch, a rank SIGKILLed at a step drawn
from a seed, with or without a restart. Each checkpoint holds the sharded state of exactly the groups in at
its round, each group's own save (the groups share no process group: a process's world is its group); the
run resumed (resume=auto) on the same layout for 2 epochs more trains every sample of them once, a group
that was out at the checkpoint taking the optimizer state of a group in, and its checkpoints hold both
groups'. About 30 s a case (two runs) on 2 busy cores."""

from __future__ import annotations

import os
import random
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.helpers.chaos_job import Job, Trial, read_samples
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_survive import (
    EVERY_EPOCH,
    RANK_STEPS,
    WORLD,
    K,
    check_left_and_back_whole,
    groups_in,
    groups_of_two,
    logs_of,
)
from tests.helpers.survive_runs import STOP_ONCE_ADMITTED

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    ("policy", "seed"), [("cadence", 0), ("cadence", 1), ("cadence", 2), ("async", 0), ("async", 1)]
)
def test_each_checkpoint_holds_the_groups_in_and_resumes_every_sample_once(
    tmp_path: Path, policy: str, seed: int
) -> None:
    rng = random.Random(f"sharded-survive-checkpoints-{policy}-{seed}")
    victim, restarts, at = rng.randrange(WORLD), rng.randint(0, 1), rng.randint(1, 2 * RANK_STEPS)
    job = Job(tmp_path)
    restart = f"launch.max_restarts={restarts}"
    groups_of_two(job, restart, *EVERY_EPOCH, until_admitted=restarts > 0, policy=policy)
    proc = job.start()
    os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
    trial = Trial("sharded-survive-checkpoints", seed, f"rank {victim} SIGKILLed at its step {at}")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    resume_and_check(job, trial, victim, restarts)


@pytest.mark.parametrize("seed", range(2))
def test_a_member_killed_at_its_groups_save_leaves_a_checkpoint_of_the_groups_in(
    tmp_path: Path, seed: int
) -> None:
    """A rank SIGKILLed as it enters its group's save of the checkpoint after the first or second epoch (its
    other waiting in the save's collectives), or once the save is written (its part not): the group leaves
    in one change, the checkpoint holds the groups in, and the run resumed from the last trains on."""
    rng = random.Random(f"sharded-survive-killed-save-{seed}")
    victim, epoch, when = rng.randrange(WORLD), rng.randint(0, 1), rng.choice(["before", "after"])
    job = Job(tmp_path)
    groups_of_two(job, "launch.max_restarts=0", *EVERY_EPOCH)
    proc = job.start(env={"FLODL_TEST_KILL_IN_SAVE": f"{victim}:{epoch}:{when}"}, hook="killed_save")
    trial = Trial("sharded-survive-killed-save", seed, f"rank {victim} SIGKILLed {when} its save of {epoch}")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, 0)
    resume_and_check(job, trial, victim, 0)


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
