"""webdataset (the real package) as its users write it for several ranks: tar shards written with its
ShardWriter, read by `wds.WebDataset(urls, nodesplitter=wds.split_by_node)` (and its default
`workersplitter=split_by_worker`). flodl sees both splitters in the pipeline and splits nothing again: on 2
gloo ranks x 2 DataLoader workers every sample is trained exactly once per epoch (counted from the ids the
loss logs), and the log says what each reader reads; a run resumed from a checkpoint inside an epoch trains
the items after those trained before it, so the resumed epoch too holds every sample once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import rank_file
from tests.helpers.byo_data import write_point_shards
from tests.helpers.procs import FAST_START, REPO, train

pytestmark = pytest.mark.multiproc
pytest.importorskip("webdataset", exc_type=ImportError)  # optional: every test here reads its shards

CONF = str(REPO / "tests" / "helpers" / "conf")
SAMPLES, SHARDS, BATCH = 96, 8, 4  # 2 shards a reader; byo_webdataset: 12 steps of 4 a rank per epoch
RANK_EPOCH = SAMPLES // 2  # the items a rank trains per epoch


def _run(tmp_path: Path, name: str, *overrides: str) -> list[list[int]]:
    """A run into `tmp_path/name`; per rank, the ids of the items it trained, in order."""
    items = tmp_path / f"{name}-items"
    items.mkdir()
    train(
        "--config-dir",
        CONF,
        "task=byo_webdataset",
        f"task.train_data.folder={tmp_path / 'shards'}",
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=sync",
        "num_workers=2",
        "checkpoint_every_steps=5",
        "checkpoint_keep=50",
        *overrides,
        f"hydra.run.dir={tmp_path / name}",
        cwd=tmp_path,
        timeout=240,
        FLODL_TEST_DRAW_DIR=str(items),
    ).check()
    return [[int(i) for i in (items / f"rank{r}.txt").read_text().split()] for r in range(2)]


def _epochs(trained: list[list[int]]) -> list[Counter[int]]:
    """How often each sample was trained in each epoch, over both ranks."""
    return [
        Counter(trained[0][e : e + RANK_EPOCH] + trained[1][e : e + RANK_EPOCH])
        for e in range(0, len(trained[0]), RANK_EPOCH)
    ]


def test_two_ranks_of_two_workers_train_every_webdataset_sample_once_an_epoch_resumed_too(
    tmp_path: Path,
) -> None:
    write_point_shards(tmp_path / "shards", SAMPLES, SHARDS)
    whole = _run(tmp_path, "whole")
    once = Counter(range(SAMPLES))
    assert [len(t) for t in whole] == [3 * RANK_EPOCH] * 2
    assert _epochs(whole) == [once] * 3
    log = (tmp_path / "whole" / "rank0.log").read_text()
    assert (
        "each of the 4 stream readers (a rank's DataLoader worker k of K=2) reads the stream's own part for "
        "its rank as DataLoader worker k of 2 reads it (the stream splits it), every item of it (its "
        "pipeline's split_by_node and split_by_worker)"
    ) in log
    # Resumed from the checkpoint inside the second epoch (step 15: each rank's 3rd batch of it, the other
    # worker's turn): each rank goes on with the items after those it trained before it.
    checkpoint, taken = next(
        (path, t)
        for path in sorted((tmp_path / "whole" / "checkpoints").glob("epoch-*-sample-*"))
        for t in [_taken(path)]
        if t[0] * BATCH > RANK_EPOCH
    )
    assert taken == [15, 15]
    after = _run(tmp_path, "split", f"resume={checkpoint}")
    resumed = [w[: t * BATCH] + a for w, t, a in zip(whole, taken, after, strict=True)]
    assert resumed == whole
    assert _epochs(resumed) == [once] * 3


def _taken(checkpoint: Path) -> list[int]:
    """Per rank, the batches it had trained at `checkpoint` (its part's stream state)."""
    return [
        torch.load(checkpoint / rank_file(r), weights_only=True)["stepper"]["data"]["taken"] for r in (0, 1)
    ]
