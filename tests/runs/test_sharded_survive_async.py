"""Survive by groups under async (docs/sharded-groups.md): 4 CPU ranks as 2 groups of 2, ElChe free with its
overshoot, a rank SIGKILLed at a moment drawn from a seed: at a step of its window (a round fires midway
through a rank's slice, a member may hold its overshoot), or as it enters the first round after a drawn step
(the round cut for one shard index while the other's may finish it, then redone). The invariants are
cadence's (tests/runs/test_sharded_survive.py): the run ends, the dead rank's group leaves in one change and,
restarted, comes back whole, every sample of every epoch is trained once (what the dead group trained since
the last round lost with it), the members of each shard index end with one state, every round averages a
group's members at one step, and the group left shares its shards with the one admitted at one step. About
16 s a run on 2 busy cores."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers.chaos_job import Job, Trial
from tests.helpers.runs import epochs_of, round_steps
from tests.helpers.sharded_survive import RANK_STEPS, WORLD, K, check_left_and_back_whole, groups_of_two

pytestmark = pytest.mark.multiproc


# 4 of 16 seeds: a window's kill restarted (its group left shared at steps 21 and 22 before the step vote
# carried the generation), a round's restarted, and two round kills that cut the round for one shard index
# only (the other's finished it).
@pytest.mark.parametrize("seed", [2, 7, 11, 13])
def test_a_group_cut_at_any_moment_under_async_leaves_and_comes_back_whole(tmp_path: Path, seed: int) -> None:
    rng = random.Random(f"sharded-survive-async-{seed}")
    victim, restarts, kill_in = rng.randrange(WORLD), rng.randint(0, 1), ("window", "round")[seed % 2]
    at = rng.randint(1, 2 * RANK_STEPS)  # round: the first round at or past this step
    job = Job(tmp_path)
    kill = [f"simulate.kill_rank={victim}", f"simulate.kill_at_step={at}", f"simulate.kill_in={kill_in}"]
    restarted = f"launch.max_restarts={restarts}"
    groups_of_two(job, "eval_every=1", restarted, *kill, until_admitted=restarts > 0, policy="async")
    proc = job.start()
    trial = Trial("sharded-survive-async", seed, f"rank {victim} SIGKILLed at its step {at} ({kill_in})")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    records = epochs_of(job.run_dir)
    evaluated = [r["epoch"] for r in records if "eval/accuracy" in r]
    assert evaluated == [r["epoch"] for r in records], (trial.plan, records)
    for steps in round_steps(job.run_dir):  # each group in the round: its members at one step
        for first in range(0, WORLD, K):
            assert len({steps[r] for r in range(first, first + K) if r in steps}) <= 1, (trial.plan, steps)
