"""Overlapped rounds end to end: 2 ranks under cadence on the cpu backend, in one process
(tests/helpers/in_process.py), every round held back on its thread so that each is surely in flight while
the next window trains (what tests/helpers/slow_round does to a rank's process). The run ends with one model
on every rank (the last round is exact) and model.pt is it; every batch is trained once and counted in one
round; each epoch's eval ran on the consensus of a round after its last batch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.averaging.host_averager import HostAverager
from tests.helpers.in_process import run_in_process

EPOCHS, BATCH, HELD_S = 4, 32, 0.2


@pytest.fixture
def held_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cpu-backend round waits HELD_S on its thread before it reduces: a slow link's stand-in."""
    reduce = HostAverager._round

    def held(self: HostAverager, *args: Any) -> None:
        time.sleep(HELD_S)
        reduce(self, *args)

    monkeypatch.setattr(HostAverager, "_round", held)


@pytest.mark.usefixtures("held_rounds")
def test_overlapped_rounds_end_with_one_model_and_train_every_batch_once(tmp_path: Path) -> None:
    overlapped = ("policy=cadence", "backend=cpu", "overlap_rounds=true")
    run = run_in_process(tmp_path / "run", 2, *overlapped, f"epochs={EPOCHS}", f"batch_size={BATCH}")
    records = run.records
    assert [r["epoch"] for r in records] == list(range(EPOCHS))

    # 1. One model: every rank's state after the last round is model.pt, bit for bit.
    model = run.model()
    for end in run.ranks:
        assert end.error is None and end.state is not None, (end.rank, end.error)
        assert all(torch.equal(end.state[key], value) for key, value in model.items()), end.rank

    # 2. Every batch trained once, each in one round.
    per_epoch = {sum(p["batches"] for p in r["per_rank"]) for r in records}
    assert len(per_epoch) == 1
    rounds = run.timeline["rounds"]
    assert sum(n for r in rounds for n in r["steps"].values()) == per_epoch.pop() * EPOCHS

    # 3. Overlapped: each rank trained the next window while rounds were in flight.
    during = [sum(r["per_rank"][rank]["steps_during_averaging"] for r in records) for rank in range(2)]
    assert all(n > 0 for n in during), during

    # 4. One eval per epoch, on the consensus of a round after the epoch's last batch; it learned.
    trained, evaluated = 0, {}
    for entry in rounds:
        trained += sum(entry["steps"].values())
        evaluated.update(dict.fromkeys(entry["evaluates"], trained))
    assert sorted(evaluated) == list(range(EPOCHS))
    for record in records:
        assert record["eval_step"] == evaluated[record["epoch"]]
        assert record["eval_samples"] >= (record["epoch"] + 1) * record["samples"]
    assert records[-1]["eval/accuracy"] >= 0.85  # the digits MLP after 4 epochs: ~0.93
