"""Checkpoints of sharded groups (docs/sharded-groups.md): 4 gloo ranks as 2 groups of 2 write each rank's
shard of the model, of its group's optimizer state and of the outer momentum (torch.distributed.checkpoint,
nothing gathered); a checkpoint inside an epoch resumes where the run left off, and on other layouts (one
group of 2, 2 groups of 1, 3 full replicas) with every sample of every epoch trained once, counted from the
reads of a Dataset that logs them. One 2x2 run per policy, its checkpoints shared by every resume."""

from __future__ import annotations

import functools
import random
import shlex
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import Point
from flodl.job.resume import continues_at
from tests.helpers.drawn import drawn_seeds
from tests.helpers.procs import PYTHON, TRAIN, run, train
from tests.helpers.resize_counts import (
    PINNED,
    POINTS,
    SAMPLES,
    read,
    resumable,
    resumed_trains_each_sample_once_an_epoch,
)
from tests.helpers.stops import check_stop_kept_every_step, hooks_env, sigterm_once_held, stopped_by_sigterm

pytestmark = pytest.mark.multiproc

EPOCHS = 3
# SGD with momentum: under cadence each group's optimizer state is its own, which a resume must take back.
MOMENTUM = ("+task.optimizer.momentum=0.9",)
# A fixed window of 2 batches a rank; a checkpoint inside each epoch.
CADENCE = ("policy=cadence", *PINNED, "divergence_guard=none", "checkpoint_every_steps=4")
RUNS = {
    # Steps of 32 samples (4 ranks), a checkpoint 96 into the second epoch: the rest is whole steps of 2 and
    # of 3 ranks too (sync drops a remainder short of a global step, as a fresh epoch's).
    "sync": ("policy=sync", "batch_size=8", "checkpoint_every_steps=3"),
    # SlowMo keeps the inner optimizer's state and has an outer momentum; DiLoCo resets the inner state.
    "slowmo": (*CADENCE, "outer=slowmo"),
    "diloco": (*CADENCE, "outer=diloco"),
    # Async at the same fixed window, its overshoot off (the rounds fall where they fell: bit for bit), each
    # round blended in but a checkpoint's, which is exact; SlowMo's outer momentum per shard too.
    "async": (*CADENCE[1:], "policy=async", "max_overshoot=0", "easgd_alpha=0.5", "outer=slowmo"),
}


class Runs:
    """The module's runs, one log of reads for all (the task's config is the checkpoint's), moved aside as
    each run ends."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def run(self, name: str, kind: str, ranks: int, groups: int, *more: str) -> tuple[Path, str]:
        """The run dir and output of a run of `kind` on `ranks` ranks, `groups` ranks a group."""
        common = (
            *POINTS,
            f"epochs={EPOCHS}",
            *MOMENTUM,
            *RUNS[kind],
            f"task.train_data.log={self.root / 'reads'}",
        )
        layout = (
            f"launch.nproc_per_node={ranks}",
            f"shard_group={groups}",
            f"hydra.run.dir={self.root / name}",
        )
        result = train(*common, *layout, *more, cwd=self.root, timeout=300).check()
        (self.root / "reads").rename(self.reads(name))
        return self.root / name, result.out

    def reads(self, name: str) -> Path:
        return self.root / f"reads-{name}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sharded-checkpoints"))


@pytest.fixture(scope="module")
def whole(runs: Runs) -> Callable[[str], Path]:
    """Each kind's uninterrupted 2x2 run (a checkpoint inside every epoch), run once, when a test asks."""

    @functools.cache
    def of(kind: str) -> Path:
        run_dir, _ = runs.run(f"whole-{kind}", kind, 4, 2)
        assert read(runs.reads(f"whole-{kind}")) == Counter({i: EPOCHS for i in range(SAMPLES)})
        return run_dir

    return of


@pytest.mark.parametrize("kind", ["slowmo", "diloco", "async"])
def test_a_sharded_local_sgd_checkpoint_resumes_where_the_run_left_off(
    runs: Runs, whole: Callable[[str], Path], kind: str
) -> None:
    # Stopped at its checkpoint inside the second epoch and resumed on the same groups, the run ends where
    # the uninterrupted one does, bit for bit: each group's optimizer state, the outer momentum, the random
    # streams and the data position are what they were.
    checkpoint = resumable(whole(kind), 2)
    saved = sorted(p.name for p in (checkpoint / "sharded").iterdir())
    assert saved == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    assert not (checkpoint / "model.pt").exists()  # the model lies in shards, nothing gathered
    name = f"again-{kind}"
    resumed, _ = runs.run(name, kind, 4, 2, f"resume={checkpoint}")
    resumed_trains_each_sample_once_an_epoch(checkpoint, runs.reads(name), EPOCHS)
    a = torch.load(whole(kind) / "model.pt", weights_only=True)
    b = torch.load(resumed / "model.pt", weights_only=True)
    assert all(torch.equal(a[key], b[key]) for key in a), {key: (a[key] - b[key]).abs().max() for key in a}


@pytest.mark.parametrize("kind", ["sync", "slowmo", "async"])
@pytest.mark.parametrize(("ranks", "size"), [(2, 2), (2, 1), (3, 1)], ids=["1x2", "2x1", "3x1"])
def test_a_two_by_two_checkpoint_resumes_on_other_groups_every_sample_once(
    runs: Runs, whole: Callable[[str], Path], kind: str, ranks: int, size: int
) -> None:
    # The 2x2 run's checkpoint inside the second epoch, resumed as one group of 2, as 2 groups of 1 (full
    # replicas) and on 3 full replicas: each rank reads its shard of the model and of the optimizer state as
    # it is laid out now, the rest of the epoch is planned over the new world, every sample once an epoch.
    checkpoint = resumable(whole(kind), 2)
    name = f"{kind}-{ranks}x{size}"
    run_dir, out = runs.run(name, kind, ranks, size, f"resume={checkpoint}")
    assert f"resumed 4 ranks' checkpoint on {ranks}" in out
    resumed_trains_each_sample_once_an_epoch(checkpoint, runs.reads(name), EPOCHS)
    logs = [(run_dir / f"rank{rank}.log").read_text() for rank in range(ranks)]
    groups = ranks // size
    if kind == "sync" or groups == 2:  # one optimizer state (sync), or each group its own as saved
        assert not any("groups resumed as" in log for log in logs)
        return
    # Under local SGD each group takes one saved group's state, g mod 2's: the third replica group 0's; one
    # group leaves group 1's.
    last = groups - 1
    rule = (
        f"a checkpoint of 2 groups resumed as {groups}: group g takes saved group g mod 2's optimizer state"
    )
    assert f"rank {ranks - 1}: group {last} takes saved group {last % 2}'s: {rule}" in logs[-1]
    assert ("(each group's is its own); saved group 1's is left" in logs[0]) == (groups == 1)


# A stop's checkpoints, segments of several windows (by epochs; by steps, 44 batches, across epochs) so that
# the stop ends a window that is not its segment's last, and the layout its checkpoint is resumed on (ranks,
# a group), one of each a seed (modulo 3). One seed drawn anew each run (tests/helpers/drawn.py): 3 in a row
# (FLODL_CHAOS_TRIALS=3) take every pair.
STOP_SCHEDULES = ("checkpoint_every=2", "checkpoint_every_steps=11", "checkpoint_every=3")
STOP_RESUMES = ((2, 2), (3, 1), (4, 2))
# 144 batches of 8: a rank held at its step 20 at the latest, at most 80 are trained by then (its group's
# 40, and the other's no more), and the stop ends a window of a few batches a rank (the slowest rank's count
# at most 2, an overshoot of 3) well before the run's end.
STOP_EPOCHS = 6


@pytest.mark.parametrize("seed", drawn_seeds("sharded-sigterm", 1))
def test_a_sigterm_under_async_with_groups_commits_every_step_trained_and_resumes_every_sample_once(
    tmp_path: Path, seed: int
) -> None:
    # ElChe free with an anchor of 1 or 2, an overshoot of 3 (windows shorter than a segment), a rank slowed:
    # each rank trains on past its count until a round's order reaches it, its group's members at one step,
    # and the stop ends the window in flight, in which ranks hold more than their count (the round after it
    # must not be the segment's final one: a checkpoint there would miss the overshoot, trained after it).
    # Every rank is held at a step drawn past the first epoch (24 batches of 8: a group trains 12 steps of it
    # at most) until the coordinator took the stop; the checkpoint at the segment's final, exact round must
    # hold every rank's part, each with every step the rank trained (the count its stop line says). Resumed on
    # the seed's layout, every sample of every epoch is trained once.
    schedule, (ranks, size) = STOP_SCHEDULES[seed % 3], STOP_RESUMES[seed % 3]
    rng = random.Random(seed)
    hold, slow, factor = rng.randint(13, 20), rng.randrange(4), rng.choice([2, 3])
    run_dir = tmp_path / "run"
    args = [
        PYTHON,
        TRAIN,
        *POINTS,
        f"epochs={STOP_EPOCHS}",
        *MOMENTUM,
        "policy=async",
        "batch_size=8",
        "anchor=1",
        "max_anchor=2",
        "max_overshoot=3",
        schedule,
        f"simulate.slow_rank={slow}",
        f"simulate.factor={factor}",
        "launch.nproc_per_node=4",
        "shard_group=2",
        f"task.train_data.log={tmp_path / 'reads'}",
        f"hydra.run.dir={run_dir}",
    ]
    result = sigterm_once_held(args, tmp_path, hooks_env(tmp_path, hold), stop_log=run_dir / "rank0.log")
    stopped_at, resume = stopped_by_sigterm(result)
    assert stopped_at.point.order > Point(0).order and stopped_at.part_ranks == (0, 1, 2, 3), stopped_at.path
    check_stop_kept_every_step(run_dir, stopped_at, stops=1)
    (tmp_path / "reads").rename(tmp_path / "reads-stopped")
    layout = (f"launch.nproc_per_node={ranks}", f"shard_group={size}")
    drawn = ("launch.nproc_per_node=", "shard_group=", "simulate.")  # the slowed rank may be gone
    again = [a for a in shlex.split(resume) if not a.startswith(drawn)]
    resumed = run([*again, *layout], cwd=tmp_path, timeout=300).check()
    assert f"training continues {continues_at(stopped_at)}" in resumed.out, resumed.out[-4000:]
    resumed_trains_each_sample_once_an_epoch(stopped_at.path, tmp_path / "reads", STOP_EPOCHS)
