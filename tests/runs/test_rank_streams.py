"""Every rank draws its own randomness: a map-style Dataset that draws in `__getitem__` (torch, numpy and
Python generators), 2 gloo ranks under sync. What each rank trained on is logged in order by the loss
(tests/helpers/byo_data.py): the ranks share no draw, a second run with the same seed draws the same per rank
(with DataLoader workers or without), and a run stopped after two epochs and resumed draws in its third
epoch what the uninterrupted run drew."""

from __future__ import annotations

from pathlib import Path

import pytest

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
