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
from pathlib import Path

import pytest

from tests.helpers.chaos_job import Job, Trial
from tests.helpers.sharded_survive import (
    EVERY_EPOCH,
    RANK_STEPS,
    WORLD,
    check_left_and_back_whole,
    groups_of_two,
    resume_and_check,
)

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
