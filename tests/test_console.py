"""The console sink: the progress bar's figures, and no bar spam without a terminal."""

from __future__ import annotations

import io

from flodl.metrics.sinks import ConsoleSink, format_duration
from flodl.wire.messages import Progress


def test_bar_shows_the_share_of_all_ranks_batches_and_their_speed() -> None:
    out = io.StringIO()
    sink = ConsoleSink(epochs=2, total_batches=100, world_size=2, out=out)
    sink.progress(Progress(rank=1, epoch=0, step=20, loss=1.0, samples_per_s=300.0, lr=0.1))
    assert out.getvalue() == ""  # only rank 0's reports draw the bar
    sink.progress(Progress(rank=0, epoch=0, step=30, loss=0.5, samples_per_s=100.0, lr=0.1))
    line = out.getvalue()
    assert "epoch 1/2" in line and " 50% " in line and "step 30" in line
    assert "loss 0.5000" in line and "400 samples/s" in line and "#" * 12 + "." * 12 in line


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
