"""Sync by sharded groups under fault_tolerance=survive (docs/sharded-groups.md#survive-by-groups): 4 gloo
ranks as 2 groups of 2, FSDP2 inside each group (its process's world) and each step's gradient shards averaged
across the groups over the members of each shard index, torchft's FT-HSDP. Without a death it ends where
HSDP does: one process on the global batch."""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.chaos_job import (
    EPOCHS,
    Job,
    Sample,
    Trial,
    check_each_sample_once,
    check_no_partial,
    read_samples,
)
from tests.helpers.drawn import drawn_seeds
from tests.helpers.procs import FAST_START, Result
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_survive import (
    EVERY_EPOCH,
    RANK_STEPS,
    WORLD,
    K,
    groups_of_two,
    logs_of,
    resume_and_check,
)
from tests.helpers.survive_runs import digests, membership, rest_lines
from tests.helpers.sync_reference import assert_matches_reference

pytestmark = pytest.mark.multiproc

LR = 1e-3  # digits' learning rate for one rank

SURVIVE_BY_GROUPS = (
    "device=cpu",
    FAST_START,
    "shard_group=2",
    "checkpoint_every=null",
    "fault_tolerance=survive",
)


def test_without_a_death_it_ends_where_hsdp_does(tmp_path: Path) -> None:
    # HSDP (tests/runs/test_sharded_sync.py) ends where one process on the global batch does, within 1e-5:
    # so does this run, evaluated after its epoch as every group's members evaluate their shares together.
    (record,) = assert_matches_reference(tmp_path, 1e-5, *SURVIVE_BY_GROUPS, world=4, evals=True)
    assert record["world"] == 4
    for rank in range(4):
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        assert f"rank {rank}: shard {rank % 2} of group {rank // 2} (FSDP2 in the group, gradients" in log


def dead_group_samples(
    job: Job, samples: list[Sample], dead: list[int], out: str
) -> tuple[set[Sample], dict[int, int]]:
    """The dead group's steps its members did not agree to (of its cut epoch, past the steps the coordinator
    says the members trained: handed out again, so trained once more), and per epoch the samples of its steps
    before that which no record counts (trained in the groups' step, never reported: it died first)."""
    pids = {int(job.files(rank)[0].stem.rsplit("-", 1)[1]) for rank in dead}  # each one's first process
    agreed = {shown - 1: trained for shown, trained, *_ in rest_lines(out)}
    window: set[Sample] = set()
    unreported: Counter[int] = Counter()
    for pid in pids:
        steps = sorted((s for s in samples if s.pid == pid), key=lambda s: s.step)
        for epoch in {s.epoch for s in steps}:
            of_epoch = [s for s in steps if s.epoch == epoch]
            cut_at = agreed.get(epoch, len(of_epoch))
            window |= set(of_epoch[cut_at:])
            unreported[epoch] += sum(len(s.ids) for s in of_epoch[:cut_at])
    for record in epochs_of(job.run_dir):  # what a dead rank reported before it died counts already
        for part in record["per_rank"]:
            if part["rank"] in dead and record["epoch"] in unreported:
                unreported[record["epoch"]] -= part["samples"]
    return window, unreported


def check_left_and_back_whole(job: Job, trial: Trial, result: Result, victim: int, restarts: int) -> None:
    """The run ended, its group left in one change (and came back whole, with `restarts`): the group left
    trained the rest of the cut epoch, every sample of every epoch once, the learning rate x the world in
    every record; restarted, each rank of the group holds its shard index's member's state, bit for bit."""
    dead = sorted([victim, victim ^ 1])
    others = sorted({0, 1, 2, 3} - set(dead))
    assert result.ok, (trial.plan, (result.out + result.err)[-3000:])
    check_no_partial(trial, job)
    changes = membership(job.run_dir)
    cuts = [e for e in changes if e["event"] == "rank_cut"]
    assert [(e["rank"] in dead, e["members"]) for e in cuts] == [(True, others)], (trial.plan, cuts)
    assert f"its group {dead} leaves with it" in cuts[0]["why"]
    records = epochs_of(job.run_dir)
    assert [r["epoch"] for r in records] == list(range(len(records) if restarts else EPOCHS))
    # The learning rate follows the world (lr_scale_ratio=1: x n for n ranks): halved with a group out (an
    # epoch the cut came in may be recorded with either), and doubled with it back.
    logs = logs_of(job.run_dir)
    assert "world 4 -> 2: global batch 64, learning rate x0.5" in logs, trial.plan
    rates = [r["lr"] for r in records]
    assert all(lr in (pytest.approx(2 * LR), pytest.approx(4 * LR)) for lr in rates), (trial.plan, rates)
    assert records[-1]["lr"] == pytest.approx(LR * records[-1]["world"]), (trial.plan, records[-1])

    # Every sample of every epoch once: the groups left trained what the dead group had not.
    samples = read_samples(job.log_dir)
    window, unreported = dead_group_samples(job, samples, dead, result.out)
    check_each_sample_once(trial, job, samples, window, unreported=unreported)
    assert trial.violations == [], (trial.plan, trial.violations)

    final = digests(logs, "the last epoch")
    if restarts:  # back whole, in one admission, each rank's shard its shard index's member's
        admitted = [e for e in changes if e["event"] == "rank_admitted"]
        assert [(e["rank"] in dead, e["members"]) for e in admitted] == [(True, [0, 1, 2, 3])], admitted
        shared = digests(logs, rf"admitting \[{dead[0]}, {dead[1]}\]")
        assert sorted(shared) == [0, 1, 2, 3], (trial.plan, shared)
        assert records[-1]["world"] == WORLD
        assert "world 2 -> 4: global batch 128, learning rate x2" in logs, trial.plan
        for index in range(K):
            assert shared[index] == shared[index + K], (trial.plan, shared)
            assert final[index] == final[index + K], (trial.plan, final)
    else:  # the group that left says no final state
        assert sorted(final) == others, (trial.plan, final)


def killed_run(tmp_path: Path, kind: str, seed: int, *overrides: str) -> tuple[Job, Trial, int, int]:
    """A run of 2 groups of 2 under sync and survive, a rank SIGKILLed after a number of its steps drawn
    from the seed (within a step, the step's averaging or the epoch's eval, as it falls), with a restart
    every other seed; its job, trial, victim and restarts, checked."""
    rng = random.Random(f"{kind}-{seed}")
    # 6 seeds in a row kill every rank, every other one with a restart (the run's host lives apart).
    victim, restarts, at = (seed + seed // 2) % WORLD, seed % 2, rng.randint(1, 2 * RANK_STEPS)
    job = Job(tmp_path)
    restart = f"launch.max_restarts={restarts}"
    groups_of_two(job, restart, *overrides, until_admitted=restarts > 0, policy="sync")
    proc = job.start()
    os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
    trial = Trial(kind, seed, f"rank {victim} SIGKILLed after its step {at}, {restarts} restart")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    return job, trial, victim, restarts


# 3 seeds in a row a run, from a start drawn anew each run (rank 0 is killed as often as any other over
# runs), each at its drawn step.
@pytest.mark.parametrize("seed", drawn_seeds("sharded-survive-sync", 3))
def test_a_ranks_death_takes_its_group_out_the_other_trains_its_rest_and_it_rejoins_whole(
    tmp_path: Path, seed: int
) -> None:
    """The coordinator cuts the dead rank's group in one change; the group left agrees where it is and
    trains the rest of the cut epoch (the dead group's untrained picks with its own, in whole steps), every
    sample of every epoch once, its learning rate following the world; restarted, the group is admitted whole
    at the next epoch, each of its ranks taking its shard (parameters, optimizer moments, schedule) from the
    member of its shard index, bit for bit."""
    killed_run(tmp_path, "sharded-survive-sync", seed)


@pytest.mark.parametrize(("seed", "inside"), [(0, ()), (1, ("checkpoint_every_steps=20",))])
def test_each_checkpoint_holds_the_groups_in_and_resumes_every_sample_once(
    tmp_path: Path, seed: int, inside: tuple[str, ...]
) -> None:
    """A checkpoint every epoch (and with `inside` every 20 steps too): each holds the saves of the groups in
    at it (each group its own: they share no world), and the run resumed on the same layout for 2 epochs
    more trains every sample of them once, a group out at the checkpoint taking a group in's optimizer
    state, its learning rate that of 4 ranks."""
    overrides = (*EVERY_EPOCH, *inside)
    job, trial, victim, restarts = killed_run(tmp_path, "survive-sync-checkpoints", seed, *overrides)
    resume_and_check(job, trial, victim, restarts)
    for record in epochs_of(job.run_dir)[-2:]:  # resumed on 4 ranks, from a checkpoint of 2 or 4
        assert record["lr"] == pytest.approx(LR * WORLD), (trial.plan, record)


# --- on one GPU, its 4 ranks sharing it over gloo (backend=cpu); not run on a GPU yet -----------------------


NEEDS_A_GPU = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
ON_THE_GPU = ("backend=cpu", "device=cuda")


@pytest.mark.gpu
@NEEDS_A_GPU
def test_on_one_gpu_it_ends_where_hsdp_does(tmp_path: Path) -> None:
    # CUDA tensors averaged over gloo (FSDP2's hook on its all-reduce stream), within 1e-4 of one CPU process
    # on the global batch (CUDA's float32 sums in other orders).
    run = [a for a in SURVIVE_BY_GROUPS if a != "device=cpu"]
    assert_matches_reference(tmp_path, 1e-4, *run, *ON_THE_GPU, world=WORLD)


@pytest.mark.gpu
@NEEDS_A_GPU
def test_on_one_gpu_a_group_leaves_and_comes_back_whole(tmp_path: Path) -> None:
    # A rank SIGKILLed after a drawn step, with a restart: its group leaves and comes back whole, each of its
    # ranks with its shard index's member's state, one state per shard index at the end.
    rng = random.Random("gpu-sharded-survive-sync")
    victim, at = rng.randrange(WORLD), rng.randint(1, 2 * RANK_STEPS)
    dead = sorted([victim, victim ^ 1])
    job = Job(tmp_path)
    groups_of_two(job, "launch.max_restarts=1", *ON_THE_GPU, until_admitted=True, policy="sync")
    job.args = [FAST_START if a == "launch.start_method=fork" else a for a in job.args if a != "device=cpu"]
    proc = job.start()
    os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
    result = job.finish(
        proc, Trial("gpu-sharded-survive-sync", 0, f"rank {victim} SIGKILLed after step {at}")
    )
    assert result.ok, (result.out + result.err)[-3000:]
    admitted = [e for e in membership(job.run_dir) if e["event"] == "rank_admitted"]
    assert [(e["rank"] in dead, e["members"]) for e in admitted] == [(True, [0, 1, 2, 3])], admitted
    logs = logs_of(job.run_dir)
    shared = digests(logs, rf"admitting \[{dead[0]}, {dead[1]}\]")
    final = digests(logs, "the last epoch")
    for index in range(K):
        assert shared[index] == shared[index + K] and final[index] == final[index + K], (shared, final)
