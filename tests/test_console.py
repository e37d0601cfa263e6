"""The console sink: the progress bar's figures, no bar spam without a terminal, an eval shown where its model
was taken; and every line counting epochs as the counting section of docs/checkpoints-and-faults.md says."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest
import torch

from flodl.links.messages import Progress
from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.sinks import ConsoleSink, format_duration
from flodl.tasks.gpt import GPT
from tests.helpers.procs import REPO, train
from tests.helpers.runs import epochs_of


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


def counting_example() -> list[str]:
    """The lines the counting section shows, in its example block."""
    guide = (REPO / "docs" / "checkpoints-and-faults.md").read_text()
    section = guide[guide.index("## Counting") :]
    block = section[section.index("```") + 3 :]
    return [line.strip() for line in block[: block.index("```")].strip().splitlines()]


@pytest.mark.multiproc
def test_every_line_counts_epochs_from_one_as_the_docs_say(tmp_path: Path) -> None:
    """The progress, checkpoint, stop, EarlyStopping and resume lines of a real run and its resumption, as
    the counting section shows them (`…` stands for what varies)."""
    stopping = (
        "callbacks=[{_target_:flodl.callbacks.EarlyStopping,monitor:eval/accuracy,mode:max,patience:1,"
        "min_delta:1.0}]"
    )
    common = ("checkpoint_every=1", "hydra.run.dir=run")
    stopped = train("epochs=4", *common, stopping, cwd=tmp_path).check().out
    assert [r["epoch"] for r in epochs_of(tmp_path / "run")] == [0, 1, 2]  # metrics.jsonl counts from 0
    resumed = train("epochs=5", *common, cwd=tmp_path).check().out
    # On a CPU no peak FLOPS is known: each run says so once.
    assert stopped.count("MFU is not known here") == resumed.count("MFU is not known here") == 1
    lines = (stopped + resumed).splitlines()
    at = 0
    for shown in counting_example():
        pattern = re.compile(".*?".join(re.escape(part) for part in shown.split("…")))
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        assert found is not None, (
            f"docs/checkpoints-and-faults.md shows {shown!r}; the terminal:\n{stopped}{resumed}"
        )
        at = found + 1


TINY_GPT = (
    "task=charlm",
    "task.model.layers=1",
    "task.model.dim=32",
    "task.model.heads=2",
    "task.model.context=32",
    "task.train_data.max_bytes=40000",
    "task.eval_data.max_bytes=8000",
    "batch_size=8",
    "epochs=2",
)


@pytest.mark.multiproc
def test_a_token_task_s_epoch_line_and_record_carry_tokens_per_s_and_mfu(tmp_path: Path) -> None:
    """A small char-level GPT on the CPU with one device's peak set (peak_tflops): tokens/s and MFU follow
    from samples/s, the context and the model's own FLOPs formula."""
    out = train(*TINY_GPT, "peak_tflops=0.5", "hydra.run.dir=run", cwd=tmp_path).check().out
    records = epochs_of(tmp_path / "run")
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * 32)
        model = GPT(layers=1, dim=32, heads=2, context=32)
        flops = model.train_flops([torch.zeros(1, 32, dtype=torch.long)])
        assert record["mfu"] == pytest.approx(record["samples_per_s"] * flops / 0.5e12)
        assert 0 <= record["data_wait"] < 1 and record["peak_memory"] == 0
        line = next(x for x in out.splitlines() if f"epoch {record['epoch'] + 1}/2  step" in x)
        assert f"{record['tokens_per_s'] / 1e3:.1f}k tok/s  MFU {record['mfu']:.1%}  data " in line
    assert "MFU is not known" not in out
