"""The hot path: per training step, flodl's sync worker dispatches no more than plain torch's loop plus the
NaN watch's one loss copy, and never reads a value back from the device (bench/step_ops.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import step_ops  # noqa: E402

# The NaN watch keeps each step's loss: select the slot, detach the loss, copy it in.
NAN_WATCH_OPS = 3


@pytest.fixture(scope="module")
def counts() -> dict[str, dict[str, float]]:
    return step_ops.compare("digits", [], torch.device("cpu"), steps=4)


def test_flodl_adds_no_host_read_per_step(counts):
    assert step_ops.extra_host_reads(counts) == 0


def test_flodl_adds_at_most_the_nan_watch_per_step(counts):
    plain, flodl = sum(counts["plain"].values()), sum(counts["flodl"].values())
    assert plain > 50  # a real step was counted: forward, backward, optimizer
    extra = {op: n - counts["plain"].get(op, 0) for op, n in counts["flodl"].items()}
    assert flodl - plain <= NAN_WATCH_OPS, {op: n for op, n in extra.items() if n > 0}
    assert extra.get("aten.copy_.default", 0) >= 1  # the watch's copy is there: the count sees flodl's step
