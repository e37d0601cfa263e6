"""A run resumed from a checkpoint taken inside an epoch continues exactly there, on 2 gloo ranks: sync and
cadence (windows pinned; with DiLoCo's outer momentum and the int8 wire's error feedback, state that lives
only in the ranks' parts) end bitwise equal to the uninterrupted run, with the same records, and so does
sync reading a stream (an IterableDataset, 2 DataLoader workers a rank, the checkpoint on an odd batch: the
other worker's turn) whose ranks go on with the items after those they trained; async, whose windows follow
timing, trains every sample of every epoch exactly once across the checkpoint (counted from the reads of a
Dataset that logs them), and cadence reading a stream, its epochs handed out by speed, trains each rank's
shard in order, every item once, across the checkpoint (counted from the ids the loss logs). The async run
checkpoints by time (at every round: the interval is a microsecond), the others by steps. A job killed while
its parts are written in the background (held there by tests/helpers/slow_write) resumes from the checkpoint
before."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import CheckpointDir, Point, rank_file
from flodl.data.partition import epoch_permutation
from tests.helpers.byo_data import reads
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    REPO,
    TRAIN,
    Result,
    child_env,
    kill_group,
    start,
    train,
    wait_for_path,
)
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

PINNED = ("anchor=4", "min_anchor=4", "max_anchor=4", "max_batch_diff=0")
SHOWN = ("epoch", "step", "lr", "loss", "eval/loss", "eval/accuracy")
CONF = str(REPO / "tests" / "helpers" / "conf")
# The byo points as a stream: 4 steps of 8 items a rank per epoch (the checkpoint at global step 5 is each
# rank's 5th batch); the loss logs each rank's items to $FLODL_TEST_DRAW_DIR.
STREAM = ("--config-dir", CONF, "task=byo_stream", "steps_per_epoch=4")


def _inside(run_dir: Path, shown_epochs: range) -> Path:
    """The first checkpoint the run took inside one of its epochs `shown_epochs` (as lines count)."""
    found = sorted(
        path
        for epoch in shown_epochs
        for path in (run_dir / "checkpoints").glob(f"epoch-{epoch:06d}-sample-*")
    )
    assert found, f"no checkpoint inside epochs {shown_epochs}: {sorted((run_dir / 'checkpoints').iterdir())}"
    return found[0]


def _run(tmp_path: Path, name: str, *overrides: str) -> Result:
    """A run into `tmp_path/name`; the ids of a stream's items its ranks train go to `tmp_path/name-items`."""
    items = tmp_path / f"{name}-items"
    items.mkdir()
    run_dir = f"hydra.run.dir={tmp_path / name}"
    return train(*overrides, run_dir, cwd=tmp_path, timeout=240, FLODL_TEST_DRAW_DIR=str(items)).check()


def _trained(tmp_path: Path, name: str) -> list[list[int]]:
    """Per rank, the ids of the stream's items it trained in run `name`, in order."""
    logs = [tmp_path / f"{name}-items" / f"rank{r}.txt" for r in range(2)]
    return [[int(i) for i in log.read_text().split()] for log in logs]


@pytest.mark.parametrize(
    ("policy", "task"),
    [("sync", ()), ("cadence", ()), ("sync", (*STREAM, "num_workers=2"))],
    ids=["sync", "cadence", "sync-stream"],
)
def test_a_run_resumed_inside_an_epoch_ends_bitwise_equal_to_the_uninterrupted_one(
    tmp_path: Path, policy: str, task: tuple[str, ...]
) -> None:
    windows = (*PINNED, "outer=diloco", "quantized_wire=int8") if policy == "cadence" else ()
    common = [
        *task,
        "launch.nproc_per_node=2",
        FAST_START,
        f"policy={policy}",
        "epochs=3",
        "checkpoint_every_steps=5",
        "checkpoint_keep=50",
        *windows,
    ]
    whole, split = tmp_path / "whole", tmp_path / "split"
    _run(tmp_path, "whole", *common)
    checkpoint = _inside(whole, range(2, 3))
    result = _run(tmp_path, "split", *common, f"resume={checkpoint}")
    into = int(checkpoint.name.split("-sample-")[1])
    assert f"training continues inside epoch 2, {into} samples into it" in result.out
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(split / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The resumed epoch's record holds what was trained before the checkpoint too: the same record.
    ran, resumed = epochs_of(whole), epochs_of(split)
    assert [r["epoch"] for r in resumed] == [1, 2]
    assert [[r.get(k) for k in SHOWN] for r in resumed] == [[r.get(k) for k in SHOWN] for r in ran[1:]]
    assert [r["per_rank"][0]["batches"] for r in resumed] == [r["per_rank"][0]["batches"] for r in ran[1:]]
    if task:  # each rank went on with the items after the 5 batches it had trained: none again, none skipped
        items, after = _trained(tmp_path, "whole"), _trained(tmp_path, "split")
        assert [i[5 * 8 :] for i in items] == after


def test_cadence_reading_a_stream_trains_each_ranks_shard_in_order_every_item_once_across_a_resume(
    tmp_path: Path,
) -> None:
    common = [
        *STREAM,
        "task.train_data._target_=tests.helpers.byo_data.ShardedPointStream",
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=cadence",
        "checkpoint_every_steps=5",
        "checkpoint_keep=50",
        "simulate.slow_rank=1",
        "simulate.factor=3",
    ]
    _run(tmp_path, "whole", *common)
    checkpoint = _inside(tmp_path / "whole", range(2, 3))
    _run(tmp_path, "split", *common, f"resume={checkpoint}")
    epoch = 4 * 2 * 8  # steps_per_epoch x ranks x batch_size
    shards = [list(range(4096))[r::2] for r in range(2)]  # ShardedPointStream's shard r of 2
    items = _trained(tmp_path, "whole")
    # Each rank trained its shard from its start, in order; every epoch's items, each once.
    assert [i == s[: len(i)] for i, s in zip(items, shards, strict=True)] == [True, True]
    assert sum(map(len, items)) == 3 * epoch
    # Resumed: each rank's items after those it trained before the checkpoint (its part says how many).
    parts = [torch.load(checkpoint / rank_file(r), weights_only=True) for r in range(2)]
    before = [part["stepper"]["data"]["positions"][0]["seen"] for part in parts]
    after = _trained(tmp_path, "split")
    went_on = zip(items, before, after, shards, strict=True)
    assert [i[:n] + a == s[: n + len(a)] for i, n, a, s in went_on] == [True, True]
    assert sum(before) + sum(map(len, after)) == 3 * epoch


def test_async_resumed_inside_an_epoch_trains_every_sample_of_every_epoch_exactly_once(
    tmp_path: Path,
) -> None:
    common = [
        "--config-dir",
        CONF,
        "task=byo_points",
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=async",
        "epochs=3",
        "checkpoint_every_s=0.000001",
        "checkpoint_every_steps=4",
        "checkpoint_keep=50",
        "anchor=2",
        "min_anchor=2",
        "max_anchor=2",
        "max_batch_diff=0",
        "max_overshoot=1",
    ]
    common.append(f"task.train_data.log={tmp_path / 'reads'}")  # the same config: the same dir
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(*common, f"hydra.run.dir={whole}", cwd=tmp_path, timeout=240).check()
    # A checkpoint by time due at every round while the last one's parts are still being written in the
    # background (a rank says Saved after its round's ack): the disk sets the pace, and the run says so once;
    # checkpoints by steps are always taken (the ones inside epochs this test resumes from).
    assert (whole / "rank0.log").read_text().count("checkpoints are taken as often as the disk allows") == 1
    (tmp_path / "reads").rename(tmp_path / "reads-whole")
    checkpoint = _inside(whole, range(2, 4))
    train(*common, f"resume={checkpoint}", f"hydra.run.dir={split}", cwd=tmp_path, timeout=240).check()
    samples = 192  # byo_points' training set, 12 batches of 16 an epoch: none dropped
    counted: Counter[int] = Counter()
    for process in reads(tmp_path / "reads-whole"):
        counted.update({i: len(v) for i, v in process.items()})
    assert counted == Counter({i: 3 for i in range(samples)})  # the uninterrupted run, checkpoints and all
    # Before the checkpoint: the slices the resumed epoch's record held (its chunks), as samples.
    state = torch.load(checkpoint / "coordinator.pt", weights_only=True)
    epoch = state["epoch"]
    order = epoch_permutation(samples, 42, epoch)  # the default seed
    before = Counter(
        int(i) for c in state["ledger"]["chunks"] for i in order[c["offset"] : c["offset"] + c["samples"]]
    )
    assert sum(before.values()) == state["into"] and max(before.values()) == 1
    after: Counter[int] = Counter()
    for process in reads(tmp_path / "reads"):
        after.update({i: len(v) for i, v in process.items()})
    # Every sample: once in the resumed epoch (before the checkpoint or after it), once in each epoch after.
    assert {i: before[i] + after[i] for i in range(samples)} == {i: 3 - epoch for i in range(samples)}
    assert sum(r["per_rank"][0]["samples"] + r["per_rank"][1]["samples"] for r in epochs_of(split)) == (
        (3 - epoch) * samples
    )


def test_a_job_killed_while_a_part_is_written_in_the_background_resumes_from_the_checkpoint_before(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=3",
        "checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
    ]
    held = {  # the parts of the checkpoint after the second epoch are held on their writer threads
        "FLODL_TEST_WRITE_DELAY_S": "600",
        "FLODL_TEST_WRITE_DELAY_FROM_EPOCH": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "helpers" / "slow_write"), str(REPO)]),
    }
    proc = start([PYTHON, TRAIN, *overrides], tmp_path, env=child_env(**held))
    try:
        wait_for_path(run_dir / "checkpoints" / "epoch-000002.partial", proc)
    finally:
        kill_group(proc)  # SIGKILL to every process of the job, while the save is in flight
    latest = CheckpointDir(run_dir, keep=2).latest()
    assert latest is not None and latest.point == Point(0)  # the one before: no half-written one is picked
    # The job again (resume=auto), its parts written at once: it continues after epoch 1 and completes.
    result = train(*overrides, cwd=tmp_path, timeout=240).check()
    assert "training continues at epoch 2" in result.out
    assert [r["epoch"] for r in epochs_of(run_dir)] == [0, 1, 2]
