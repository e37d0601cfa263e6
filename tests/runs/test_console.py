"""The console sink: the progress bar's figures, no bar spam without a terminal, an eval shown where its model
was taken; and every line counting epochs as the counting section of docs/checkpoints-and-faults.md says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flodl.tasks.gpt import GPT
from tests.helpers.procs import REPO, train
from tests.helpers.runs import epochs_of


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
