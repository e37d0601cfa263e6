"""Survive by groups (docs/survive.md, docs/sharded-groups.md): 4 CPU ranks as 2 groups of 2 under cadence
with fault_tolerance=survive, a rank SIGKILLed at a step drawn from a seed. Its group leaves whole (its other
rank is cut with it and its process ended), the other group trains on to the end, every sample of every
epoch trained once (what the dead group trained since the last round lost with it), and the members left
end with one state per shard index. With a restart the group comes back whole, in one admission, each of its
ranks taking its shard (parameters and optimizer moments) from the member holding its shard index, and every
group ends with the same state per shard index, bit for bit. Every epoch is evaluated: a group's members
evaluate each round together, and each epoch's eval is in its record once. About 15 s a run on 2 busy
cores."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

import pytest

from tests.helpers.chaos_job import Job, Trial
from tests.helpers.drawn import drawn_seeds
from tests.helpers.procs import FAST_START, PYTHON, TRAIN, start
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_survive import (
    RANK_STEPS,
    WORLD,
    K,
    check_left_and_back_whole,
    groups_of_two,
    logs_of,
)
from tests.helpers.survive_runs import (
    EPOCHS_AT_MOST,
    check_every_epoch_once,
    digests,
    finish_with_joiners,
    membership,
)

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    ("group", "seed", "restarts", "unreported"),
    [
        (1, 0, 0, False),
        (1, 0, 1, False),
        (0, 0, 0, False),  # rank 0
        (0, 0, 1, False),
        # SIGKILLed by itself after a chunk's steps, before its report (its group's other reported them).
        (1, 0, 1, True),
    ],
)
def test_a_ranks_death_takes_its_group_out_the_other_trains_on_and_it_rejoins_whole(
    tmp_path: Path, group: int, seed: int, restarts: int, unreported: bool
) -> None:
    rng = random.Random(f"sharded-survive-{group}-{seed}-{unreported}")
    # Group 0's victim is rank 0 (the run's host lives apart under survive: rank 0 dies as any rank does).
    victim = 0 if group == 0 else rng.choice([2, 3])
    at = rng.randint(1, 2 * RANK_STEPS) if not unreported else rng.randint(1, 4)
    job = Job(tmp_path)
    groups_of_two(job, f"launch.max_restarts={restarts}", until_admitted=restarts > 0)
    if unreported:
        proc = job.start(env={"FLODL_TEST_KILL_BEFORE_REPORT": f"{victim}:{at}"})
        plan = f"rank {victim} SIGKILLed before its chunk report {at}"
    else:
        proc = job.start()
        os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
        plan = f"rank {victim} SIGKILLed at its step {at}"
    trial = Trial("sharded-survive", seed, plan)
    lost = check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    if unreported:
        # It died at a chunk's end: nothing of its window is trained again (its chunks since the last round
        # lost with the group, the last one too, which its group's other reported), and a line says so.
        assert lost and trial.retrained == 0, (lost, trial.retrained)


# Digits on 4 ranks: every epoch's last round evaluates it. A rank killed as it enters a round cuts the
# round for its shard index's members, while the other shard index's may finish it. Seeds drawn anew each
# run (tests/helpers/drawn.py), 3 in a row: both kinds of kill, one of them twice.
@pytest.mark.parametrize("seed", drawn_seeds("sharded-survive-evals", 3))
def test_a_group_cut_at_any_moment_evaluates_each_epoch_once_with_its_members_together(
    tmp_path: Path, seed: int
) -> None:
    """A rank killed at a moment drawn from the seed, at a step of its window or, every other seed, as it
    enters the round that ends the first or second epoch (or the one before): the surviving group's
    members evaluate each round at the same round, and every epoch's eval is in its record once."""
    rng = random.Random(f"sharded-survive-evals-{seed}")
    victim, restarts, kill_in = rng.randrange(WORLD), rng.randint(0, 1), ("window", "round")[seed % 2]
    ends = RANK_STEPS * rng.randint(1, 2) - rng.randint(0, 1)  # the first round at or past this step
    at = rng.randint(1, 2 * RANK_STEPS) if kill_in == "window" else ends
    job = Job(tmp_path)
    kill = [f"simulate.kill_rank={victim}", f"simulate.kill_at_step={at}", f"simulate.kill_in={kill_in}"]
    groups_of_two(job, "eval_every=1", f"launch.max_restarts={restarts}", *kill, until_admitted=restarts > 0)
    proc = job.start()
    trial = Trial("sharded-survive-evals", seed, f"rank {victim} SIGKILLed at its step {at} ({kill_in})")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    records = epochs_of(job.run_dir)
    evaluated = [r["epoch"] for r in records if "eval/accuracy" in r]
    assert evaluated == [r["epoch"] for r in records], (trial.plan, records)


def test_a_job_grows_by_a_whole_group_of_joiners(tmp_path: Path) -> None:
    """One group of 2 with launch.max_ranks=4: two `flodl-join` started at once take seats 2 and 3, a group of
    its own; it is admitted whole once both wait, each joiner taking its shard from the member holding its
    shard index, and the run ends with one state per shard index."""
    grown = "callbacks=[{_target_:tests.helpers.callback_log.StopOnceGrown,world:4}]"
    job = start(
        [
            PYTHON,
            TRAIN,
            "launch.nproc_per_node=2",
            "launch.max_ranks=4",
            FAST_START,
            "fault_tolerance=survive",
            "policy=cadence",
            f"shard_group={K}",
            "device=cpu",
            "checkpoint_every=null",
            f"epochs={EPOCHS_AT_MOST}",
            "batch_size=8",
            grown,
            "hydra.run.dir=run",
        ],
        tmp_path,
    )
    run = tmp_path / "run"
    result, codes = finish_with_joiners(job, run, tmp_path, K)
    result.check()
    assert codes == [0, 0], codes
    admitted = [e for e in membership(run) if e["event"] == "rank_admitted"]
    assert [(e["rank"] in (2, 3), e["members"]) for e in admitted] == [(True, [0, 1, 2, 3])], admitted
    assert "its group [2, 3] with it" in admitted[0]["why"]
    logs = logs_of(run)
    shared = dict(re.findall(r"rank (\d+): state after admitting \[2, 3\]: (.+)", logs))
    final = digests(logs, "final round")
    for index in range(K):  # parameters and optimizer moments as the member of its shard index holds them
        assert shared[str(index)] == shared[str(index + K)], shared
        assert final[index] == final[index + K], final
    records = check_every_epoch_once(run)
    assert records[0]["world"] == 2 and records[-1]["world"] == 4, [r["world"] for r in records]
