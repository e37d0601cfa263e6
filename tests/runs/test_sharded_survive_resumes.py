"""Checkpoints of survive by groups resumed on other layouts (docs/sharded-groups.md#checkpoints): runs of 4
CPU ranks as 2 groups of 2 with DiLoCo (its outer momentum per shard) and fault_tolerance=survive, a
checkpoint every epoch, a rank SIGKILLed at a step of the second epoch drawn from a seed. Under cadence
without a restart its checkpoints after the first epoch hold both groups' saves, the later ones the group
left's alone; under async with a restart the last holds both groups' again, after the admission. Each
checkpoint's saves hold one consensus and one outer momentum. Each resume takes one checkpoint, 2 epochs
more, on another layout (1 group of 2, 2 and 3 full replicas, under survive) or without survive on the same
groups: every sample of its epochs trained once; each rank's state once read (tests/helpers/resumed_state),
its group's shards put together, is the checkpoint's consensus and the outer momentum of the saved group it
took, alike in every group. A first run is shared by the resumes of it. A rank SIGKILLed before its first
chunk report (a batch its group trained lost with it), a checkpoint inside that epoch resumed on a layout
drawn from a seed: every sample of the epoch trained once, before the checkpoint or after it; and so with
2 full replicas, one SIGKILLed past its first report."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from flodl.checkpoints.disk import rank_file
from flodl.checkpoints.sharded import (
    MODEL_KEY,
    OUTER_KEY,
    SHARDED_DIR,
    save_of,
    saved_groups,
    source_group,
    whole,
    whole_model,
)
from tests.helpers.chaos_job import START_TIMEOUT_S, Job, Sample, Trial, read_samples, window_of_the_dead
from tests.helpers.drawn import drawn_seeds
from tests.helpers.procs import Result, finish
from tests.helpers.resize_counts import PINNED, resumable
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_survive import (
    EVERY_EPOCH,
    RANK_STEPS,
    WORLD,
    K,
    check_left_and_back_whole,
    groups_in,
    groups_of_two,
    window_of_the_group,
)
from tests.helpers.survive_runs import STOP_ONCE_ADMITTED

pytestmark = pytest.mark.multiproc

SEED = 0
DILOCO = "outer=diloco"  # its inner state reset at every round: a group's save holds its outer momentum


@dataclass(frozen=True)
class Survived:
    job: Job
    trial: Trial
    # Its checkpoints by what they hold: "both" (the last with both groups in), "last" (the last of all).
    checkpoints: dict[str, Path]


@pytest.fixture(scope="module")
def survived(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Survived]:
    """The 2x2 run under `policy` with `restarts` (0: its last checkpoints hold the group left's alone; 1:
    the dead group restarted and admitted back, the run stopped once it was, its last checkpoint both
    groups' again), run once, when a test asks."""

    @functools.cache
    def of(policy: str, restarts: int) -> Survived:
        rng = random.Random(f"sharded-survive-resumes-{SEED}-{policy}-{restarts}")
        # Past the first epoch's checkpoint (each rank's 11 steps, a step or two more where the groups'
        # windows differ), within the second epoch.
        victim, at = rng.randrange(WORLD), rng.randint(RANK_STEPS + 3, 2 * RANK_STEPS)
        job = Job(tmp_path_factory.mktemp(f"survived-{policy}-{restarts}"))
        groups_of_two(
            job, f"launch.max_restarts={restarts}", *EVERY_EPOCH, DILOCO, until_admitted=restarts > 0
        )
        proc = job.start()
        os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
        trial = Trial("sharded-survive-resumes", SEED, f"rank {victim} SIGKILLed at its step {at}")
        check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
        held = groups_in(job.run_dir / "checkpoints", key=lambda _: OUTER_KEY)
        both = [name for name, groups in held.items() if groups == (0, 1)]
        last = (0, 1) if restarts else (1 - victim // K,)
        assert both and held[max(held)] == last, (trial.plan, held)
        for name in held:  # every group's save holds the one consensus and the one outer momentum
            sharded = job.run_dir / "checkpoints" / name / SHARDED_DIR
            saves = [save_of(sharded, group) for group in saved_groups(sharded) or ()]
            for key in (MODEL_KEY, OUTER_KEY):
                assert all(_alike(whole(saves[0], key), whole(s, key)) for s in saves[1:]), (name, key)
        checkpoints = job.run_dir / "checkpoints"
        return Survived(job, trial, {"both": checkpoints / max(both), "last": checkpoints / max(held)})

    return of


# (ranks, shard_group, fault_tolerance, the first run's policy and restarts, which of its checkpoints): every
# layout resumes under survive but the last; a group out at the checkpoint (the last without a restart)
# takes the group in's state.
LAYOUTS = {
    "1x2": (2, 2, "survive", "cadence", 0, "last"),
    "2x1": (2, 1, "survive", "cadence", 0, "both"),
    "3x1-async-after-an-admission": (3, 1, "survive", "async", 1, "last"),
    "2x2-without-survive": (4, 2, "none", "cadence", 0, "last"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_survive_by_groups_checkpoint_resumes_on_another_layout(
    survived: Callable[[str, int], Survived], tmp_path: Path, layout: str
) -> None:
    ranks, size, tolerance, policy, restarts, which = LAYOUTS[layout]
    first_run = survived(policy, restarts)
    checkpoint, trial = first_run.checkpoints[which], first_run.trial
    assert "sample" not in checkpoint.name, checkpoint  # epoch-E: after E epochs, the next one E (from 0)
    first = int(checkpoint.name.split("-")[1])
    dumps = tmp_path / "resumed"
    job, result = _resumed(first_run.job, tmp_path, (ranks, size, tolerance), first + 2, checkpoint, dumps)
    assert result.ok, (trial.plan, layout, (result.out + result.err)[-3000:])

    # Every sample of the resumed epochs once.
    records = {r["epoch"]: r for r in epochs_of(job.run_dir)}
    assert sorted(records) == [first, first + 1], (trial.plan, sorted(records))
    trained: dict[int, Counter[int]] = defaultdict(Counter)
    for sample in read_samples(job.log_dir):
        trained[sample.epoch].update(sample.ids)
    assert sorted(trained) == [first, first + 1], (trial.plan, sorted(trained))
    for epoch, ids in trained.items():
        assert set(ids.values()) == {1} and len(ids) == records[epoch]["samples"], (trial.plan, epoch)

    # Each group's state once read: the checkpoint's consensus, and the outer momentum of the saved group it
    # took, the same in every group.
    sharded = checkpoint / SHARDED_DIR
    saved = saved_groups(sharded)
    assert saved is not None, sharded
    consensus = whole_model(sharded)
    held = [torch.load(dumps / f"rank{r}.pt", weights_only=True) for r in range(ranks)]
    momenta = []
    for group in range(ranks // size):
        members = held[group * size : (group + 1) * size]
        assert all(m["group"] == group for m in members), (layout, [m["group"] for m in members])
        source = save_of(sharded, source_group(group, saved))
        expected = {"model": consensus, "momentum": whole(source, OUTER_KEY)}
        for what, tensors in expected.items():
            got = _put_together([m[what] for m in members])
            assert got.keys() == tensors.keys(), (layout, what)
            unlike = [name for name in got if not torch.equal(got[name], tensors[name])]
            assert not unlike, (trial.plan, layout, group, what, unlike)
        momenta.append(_put_together([m["momentum"] for m in members]))
    assert all(_alike(momenta[0], m) for m in momenta[1:]), (trial.plan, layout)


def _resumed(
    first: Job, work: Path, layout: tuple[int, int, str], epochs: int, checkpoint: Path, dumps: Path
) -> tuple[Job, Result]:
    """`first`'s job resumed from `checkpoint` on `layout` (ranks, shard_group, fault_tolerance) for `epochs`
    in all, in a run dir of its own under `work`, each rank writing its state once read under `dumps`."""
    ranks, size, tolerance = layout
    job = Job(work)
    replaced = ("launch.nproc_per_node=", "shard_group=", "epochs=", "fault_tolerance=", "launch.max_")
    kept = [a for a in first.args[:-1] if a != STOP_ONCE_ADMITTED]  # hydra.run.dir last
    job.args = [a for a in kept if not a.startswith(replaced)]
    job.args += [
        f"launch.nproc_per_node={ranks}",
        f"shard_group={size}",
        f"fault_tolerance={tolerance}",
        f"epochs={epochs}",
        f"resume={checkpoint}",
        f"hydra.run.dir={job.run_dir}",
    ]
    proc = job.start(env={"FLODL_TEST_RESUMED_STATE": str(dumps)}, hook="resumed_state")
    return job, finish(proc, START_TIMEOUT_S)


def _put_together(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """A group's members' local rows of each tensor, in member order: the whole tensor (each cut along its
    first dimension)."""
    return {name: torch.cat([shard[name] for shard in shards]) for name in shards[0]}


def _alike(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


# Windows of 2 batches a rank and a checkpoint every 6 global steps (one step of every rank: 11 an epoch),
# the first inside the first epoch, after the victim's group left at its first chunk report.
INSIDE = ("checkpoint_every_steps=6", "checkpoint_keep=100", *PINNED)
RESUMED_ON = ((2, 2, "survive"), (3, 1, "survive"), (4, 2, "none"))


@pytest.mark.parametrize("seed", drawn_seeds("sharded-survive-resumes-inside", 1))
def test_a_checkpoint_inside_an_epoch_a_group_left_unreported_resumes_every_sample_once(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(f"sharded-survive-resumes-inside-{seed}")
    victim, layout = rng.randrange(WORLD), rng.choice(RESUMED_ON)
    first = Job(tmp_path / "first")
    groups_of_two(first, "launch.max_restarts=0", *INSIDE)
    proc = first.start(env={"FLODL_TEST_KILL_BEFORE_REPORT": f"{victim}:1"})
    trial = Trial("sharded-survive-resumes-inside", seed, f"rank {victim} SIGKILLed before its report 1")
    check_left_and_back_whole(first, trial, first.finish(proc, trial), victim, 0)
    checkpoint = resumable(first.run_dir, 1)
    survivors = tuple(r for r in range(WORLD) if r // K != victim // K)
    parts = json.loads((checkpoint / "manifest.json").read_text())["ranks"]
    assert tuple(parts) == survivors, (trial.plan, parts)
    window = window_of_the_group(first, trial, read_samples(first.log_dir), victim)
    _resumed_inside_every_sample_once(first, trial, checkpoint, layout, tmp_path, window)


@pytest.mark.parametrize("seed", drawn_seeds("survive-resumes-inside", 1))
def test_a_checkpoint_inside_an_epoch_a_replica_left_resumes_every_sample_once(
    tmp_path: Path, seed: int
) -> None:
    """So with full replicas: 2 ranks, one SIGKILLed at a step drawn past its first report (the chunks it
    reported stand in the epoch's record; without them the resumed run waited for the epoch's end for
    good). Its steps since the last round are handed out again (or lost), not counted before the
    checkpoint."""
    rng = random.Random(f"survive-resumes-inside-{seed}")
    victim, at = rng.randrange(2), rng.randint(3, 5)
    first = Job(tmp_path / "first")
    first.configure(
        "policy=cadence", "fault_tolerance=survive", "device=cpu", "launch.max_restarts=0", *INSIDE
    )
    proc = first.start()
    pid = first.at_step(proc, victim, at)
    os.kill(pid, signal.SIGKILL)
    trial = Trial("survive-resumes-inside", seed, f"rank {victim} SIGKILLed at its step {at}")
    result = first.finish(proc, trial)
    assert result.ok, (trial.plan, (result.out + result.err)[-3000:])
    window = window_of_the_dead(trial, first, read_samples(first.log_dir), victim, pid)
    checkpoint = resumable(first.run_dir, 1)
    _resumed_inside_every_sample_once(first, trial, checkpoint, (2, 1, "survive"), tmp_path, window)


def _resumed_inside_every_sample_once(
    first: Job, trial: Trial, checkpoint: Path, layout: tuple[int, int, str], work: Path, window: set[Sample]
) -> None:
    """`checkpoint`, inside the first epoch of `first` after a death, resumed on `layout` to the end of the
    second: the first epoch's samples trained before it (a rank out's, but its `window` handed out again,
    and each member's steps its part holds) and after it each once (of the window, once or lost), the
    second's each once."""
    parts = json.loads((checkpoint / "manifest.json").read_text())["ranks"]
    held = {r: torch.load(checkpoint / rank_file(r), weights_only=True) for r in parts}
    steps = {r: part["stepper"]["steps_total"] for r, part in held.items()}
    job, result = _resumed(first, work / "resumed", layout, 2, checkpoint, work / "dumps")
    assert result.ok, (trial.plan, layout, (result.out + result.err)[-3000:])
    assert [r["epoch"] for r in epochs_of(job.run_dir)] == [0, 1], trial.plan
    trained: dict[int, Counter[int]] = defaultdict(Counter)
    for sample in read_samples(first.log_dir):
        before = sample.rank not in parts or sample.step <= steps[sample.rank]
        if sample.epoch == 0 and before and sample not in window:
            trained[0].update(sample.ids)
    for sample in read_samples(job.log_dir):
        trained[sample.epoch].update(sample.ids)
    assert sorted(trained) == [0, 1], (trial.plan, sorted(trained))
    lost = {i for sample in window for i in sample.ids} - set(trained[0])  # not handed out again
    for epoch, ids in trained.items():
        twice = sorted(i for i, n in ids.items() if n > 1)
        whole = len(ids) + (len(lost) if epoch == 0 else 0)
        assert not twice and whole == len(trained[1]), (trial.plan, layout, epoch, whole, twice[:5])
