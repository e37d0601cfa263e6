"""Every rank draws its own randomness: a map-style Dataset that draws in `__getitem__` (torch, numpy and
Python generators), 2 gloo ranks under sync. What each rank trained on is logged in order by the loss
(tests/helpers/byo_data.py): the ranks share no draw, a second run with the same seed draws the same per rank
(with DataLoader workers or without), and a run stopped after two epochs and resumed draws in its third
epoch what the uninterrupted run drew."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.data.streams import SeededIndices, SeededReads, batch_seed, seed_rank_streams
from flodl.worker.task_setup import TaskSettings, build_task
from tests.helpers.byo_data import DrawingPoints
from tests.helpers.procs import FAST_START, REPO, train

CONF = str(REPO / "tests" / "helpers" / "conf")
SAMPLES, BATCH = 192, 16
STEPS_PER_EPOCH = SAMPLES // (2 * BATCH)


def _run(tmp_path: Path, name: str, *overrides: str) -> None:
    train(
        "--config-dir",
        CONF,
        "task=byo_points",
        "task.train_data._target_=tests.helpers.byo_data.DrawingPoints",
        "task.loss._target_=tests.helpers.byo_data.drawn_loss",
        "task.eval_data=null",
        "task.eval_fn=null",
        "policy=sync",
        "device=cpu",
        "launch.nproc_per_node=2",
        FAST_START,
        f"batch_size={BATCH}",
        f"hydra.run.dir={tmp_path / ('run-' + name)}",
        *overrides,
        cwd=tmp_path,
        timeout=240,
        FLODL_TEST_DRAW_DIR=str(tmp_path / name),
    ).check()


def _trained(tmp_path: Path, name: str) -> list[list[str]]:
    """Per rank, the digests of the draws of every sample it trained on, in training order."""
    return [(tmp_path / name / f"rank{r}.txt").read_text().split() for r in range(2)]


@pytest.mark.multiproc
def test_each_rank_draws_its_own_reproducible_stream_and_a_resume_draws_what_the_run_would(tmp_path: Path):
    for name in ("whole", "first", "resumed"):
        (tmp_path / name).mkdir()
    _run(tmp_path, "whole", "epochs=3", "num_workers=2")
    _run(tmp_path, "first", "epochs=2", "num_workers=0", "checkpoint_every=1")
    # The same run dir continued for one more epoch (resume=auto), its reads in one worker process.
    (tmp_path / "run-resumed").symlink_to(tmp_path / "run-first")
    _run(tmp_path, "resumed", "epochs=3", "num_workers=1", "checkpoint_every=1")

    whole, first, resumed = (_trained(tmp_path, n) for n in ("whole", "first", "resumed"))
    per_epoch = STEPS_PER_EPOCH * BATCH
    assert [len(d) for d in whole] == [3 * per_epoch] * 2
    # 1. The ranks draw apart: at most 1% of one rank's draws also occur on the other.
    shared = set(whole[0]) & set(whole[1])
    assert len(shared) <= 0.01 * len(whole[0]), f"{len(shared)} of {len(whole[0])} draws shared by both ranks"
    # 2. The same seed draws the same per rank, whether DataLoader workers read (whole) or the rank (first).
    assert [d[: 2 * per_epoch] for d in whole] == first
    # 3. The resumed third epoch draws what the uninterrupted run drew in it.
    assert resumed == [d[2 * per_epoch :] for d in whole]


def test_the_model_is_built_alike_on_every_rank_then_each_rank_draws_its_own_stream():
    settings = TaskSettings(
        targets={
            "model": {"_target_": "tests.helpers.byo_data.linear"},
            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
            "scheduler": None,
            "eval_data": None,
            "train_data": {"_target_": "tests.helpers.byo_data.NoisyPoints", "n": 8},
            "cacheable": None,
            "loss": {"_target_": "tests.helpers.byo_data.dict_loss", "_partial_": True},
            "eval_fn": None,
            "transform": None,
            "collate_fn": None,
        },
        seed=7,
        lr_scale_ratio=1.0,
        check_purity=False,
    )
    built = [build_task(settings, torch.device("cpu"), 2, rank) for rank in (0, 1)]
    first_draw = []
    for rank in (0, 1):
        seed_rank_streams(7, rank)  # where build_task left this rank's generators
        first_draw.append(torch.rand(4))
    assert all(torch.equal(a, b) for a, b in zip(*(p.model.parameters() for p in built), strict=True))
    assert not torch.equal(*first_draw)
    build_task(settings, torch.device("cpu"), 2, 1)
    assert torch.equal(torch.rand(4), first_draw[1])


def test_a_batch_read_draws_its_own_stream_and_leaves_the_reader_s_where_it_was():
    reads = SeededReads(DrawingPoints(n=32))
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    batch = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 0, 5)))
    assert torch.equal(torch.rand(3), expected_next)  # the reader's own stream did not move
    again = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 0, 5)))
    other = reads.__getitems__(SeededIndices([1, 2, 3], batch_seed(42, 1, 5)))
    assert [s[2] for s in batch] == [s[2] for s in again]
    assert not {s[2] for s in batch} & {s[2] for s in other}
