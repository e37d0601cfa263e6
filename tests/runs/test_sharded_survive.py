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
from collections import Counter
from pathlib import Path

import pytest
import torch

from flodl.tasks.digits import DigitsMLP
from tests.helpers.chaos_job import (
    EPOCHS,
    Job,
    Trial,
    check_each_sample_once,
    check_no_partial,
    read_samples,
    window_of_the_dead,
)
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TRAIN,
    Result,
    start,
)
from tests.helpers.runs import epochs_of
from tests.helpers.survive_runs import (
    EPOCHS_AT_MOST,
    check_every_epoch_once,
    digests,
    finish_with_joiners,
    membership,
)

pytestmark = pytest.mark.multiproc

WORLD, K = 4, 2
# Digits on 4 ranks: 11 steps of 32 samples each an epoch per rank; a kill within the first half of the run.
RANK_STEPS = 11
BATCH = 32  # digits' batch_size


def groups_of_two(job: Job, *overrides: str, until_admitted: bool = False) -> None:
    job.configure(
        "policy=cadence",
        "fault_tolerance=survive",
        f"shard_group={K}",
        "device=cpu",
        "checkpoint_every=null",
        *overrides,
        until_admitted=until_admitted,
    )
    job.args = [f"launch.nproc_per_node={WORLD}" if a == "launch.nproc_per_node=2" else a for a in job.args]


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
    lost = _check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    if unreported:
        # It died at a chunk's end: nothing of its window is trained again (its chunks since the last round
        # lost with the group, the last one too, which its group's other reported), and a line says so.
        assert lost and trial.retrained == 0, (lost, trial.retrained)


# Digits on 4 ranks: every epoch's last round evaluates it. A rank killed as it enters a round cuts the
# round for its shard index's members, while the other shard index's may finish it.
@pytest.mark.parametrize("seed", range(8))
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
    _check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
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
    logs = _logs_of(run)
    shared = dict(re.findall(r"rank (\d+): state after admitting \[2, 3\]: (.+)", logs))
    final = digests(logs, "final round")
    for index in range(K):  # parameters and optimizer moments as the member of its shard index holds them
        assert shared[str(index)] == shared[str(index + K)], shared
        assert final[index] == final[index + K], final
    records = check_every_epoch_once(run)
    assert records[0]["world"] == 2 and records[-1]["world"] == 4, [r["world"] for r in records]


def _check_left_and_back_whole(
    job: Job, trial: Trial, result: Result, victim: int, restarts: int
) -> Counter[int]:
    """The run ended, its group left in one change (and came back whole, with `restarts`), every sample of
    every epoch trained once, the members ending with one state per shard index; the samples per epoch the
    dead group trained and never reported (lost with it)."""
    mate = victim + 1 if victim % K == 0 else victim - 1
    pid, mate_pid = (int(job.files(r)[0].stem.rsplit("-", 1)[1]) for r in (victim, mate))
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

    logs = _logs_of(job.run_dir) + (job.run_dir / "coordinator.log").read_text()
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
    cut = cuts[0]["rank"]
    window = window_of_the_dead(trial, job, samples, victim, pid, cut_with=cut)
    window |= window_of_the_dead(trial, job, samples, mate, mate_pid, cut_with=cut)
    # Steps the dead rank trained with its group and died before reporting: lost, not in the record.
    lost: Counter[int] = Counter()
    for batches, shown in re.findall(r"(\d+) batch\(es\) of epoch (\d+) trained and not reported", logs):
        lost[int(shown) - 1] += int(batches) * BATCH
    check_each_sample_once(trial, job, samples, window, may_lose=True, unreported=lost)
    assert trial.violations == [], (trial.plan, trial.violations)
    return lost


def _logs_of(run: Path) -> str:
    return "".join((run / f"rank{r}.log").read_text() for r in range(WORLD))
