"""The console sink: the progress bar's figures, no bar spam without a terminal, an eval shown where its model
was taken; and every line counting epochs as the counting section of docs/checkpoints-and-faults.md says."""

from __future__ import annotations

import io
import logging

import pytest

from flodl.links.messages import Progress
from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.sinks import ConsoleSink, format_duration


def test_bar_shows_the_share_of_all_ranks_batches_and_their_speed() -> None:
    out = io.StringIO()
    sink = ConsoleSink(epochs=2, total_batches=100, world_size=2, out=out)
    sink.progress(Progress(rank=1, epoch=0, step=20, loss=1.0, samples_per_s=300.0, lr=0.1))
    assert out.getvalue() == ""  # only rank 0's reports draw the bar
    sink.progress(Progress(rank=0, epoch=0, step=30, loss=0.5, samples_per_s=100.0, lr=0.1))
    line = out.getvalue()
    assert "epoch 1/2" in line and " 50% " in line and "step 30" in line
    assert "loss 0.5000" in line and "400 samples/s" in line and "#" * 12 + "." * 12 in line


def test_the_bar_counts_steps_as_the_epoch_lines_do() -> None:
    """The busiest rank's steps so far (local SGD: ranks differ), also after that rank is cut."""
    out = io.StringIO()
    sink = ConsoleSink(epochs=2, total_batches=1000, world_size=2, out=out)
    sink.progress(Progress(rank=1, epoch=0, step=328, loss=1.0, samples_per_s=300.0, lr=0.1))
    later = Progress(rank=0, epoch=1, step=310, loss=1.0, samples_per_s=100.0, lr=0.1)
    sink.progress(later)  # rank 1 was cut: rank 0 trains on, behind it
    assert " step 328 " in sink.render(later)


def test_without_a_terminal_the_bar_is_a_plain_line_at_most_every_ten_seconds() -> None:
    out = io.StringIO()
    sink = ConsoleSink(epochs=1, total_batches=10, world_size=1, out=out)
    for step in (1, 2, 3):
        sink.progress(Progress(rank=0, epoch=0, step=step, loss=1.0, samples_per_s=1.0, lr=0.1))
    assert out.getvalue().count("\n") == 1 and "\r" not in out.getvalue()


def test_durations_read_as_clock_times() -> None:
    assert format_duration(65) == "1:05"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(-3) == "0:00"


def epoch_line(metrics: EpochMetrics, caplog: pytest.LogCaptureFixture) -> str:
    sink = ConsoleSink(epochs=8, total_batches=100, world_size=2, out=io.StringIO())
    with caplog.at_level(logging.INFO, logger="flodl"):
        sink.emit(metrics)
    line, *after = [r.getMessage() for r in caplog.records]
    assert all("MFU is not known" in said for said in after), after
    return line


def test_an_eval_is_shown_at_the_step_its_model_was_taken(caplog: pytest.LogCaptureFixture) -> None:
    """Async: the eval of epoch 4 (0-based) ran on the consensus of a round well after the epoch's end."""
    measured = dict(epoch=4, step=1408, loss=0.5, samples=640, epoch_s=1.0, samples_per_s=640.0)
    late = EpochMetrics(**measured, eval={"accuracy": 0.9}, eval_at_step=1984, eval_samples=3968)
    line = epoch_line(late, caplog)
    assert line.startswith("epoch 5/8  step 1408  loss 0.5000  eval/accuracy 0.9000 (at step 1984)  "), line
    caplog.clear()
    at_the_end = EpochMetrics(**measured, eval={"accuracy": 0.9}, eval_at_step=1408, eval_samples=2816)
    assert "eval/accuracy 0.9000  640 samples/s" in epoch_line(at_the_end, caplog)
