"""Overlapped rounds end to end: 2 gloo ranks under cadence on the cpu backend, every round held back on its
thread (tests/helpers/slow_round) so that each is surely in flight while the next window trains. The run ends
with one model on every rank (the last round is exact) and model.pt is it; every batch is trained once and
counted in one round; each epoch's eval ran on the consensus of a round after its last batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import FAST_START, held_rounds_env, train
from tests.helpers.runs import assert_complete_run

pytestmark = pytest.mark.multiproc

EPOCHS, BATCH = 4, 32


def test_overlapped_rounds_end_with_one_model_and_train_every_batch_once(tmp_path: Path) -> None:
    states = tmp_path / "states"
    states.mkdir()
    train(
        "policy=cadence",
        "backend=cpu",
        "overlap_rounds=true",
        "launch.nproc_per_node=2",
        FAST_START,
        f"epochs={EPOCHS}",
        f"batch_size={BATCH}",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
        **held_rounds_env(0.2, FLODL_TEST_FINAL_STATE_DIR=str(states)),
    ).check()
    run = tmp_path / "run"
    records = assert_complete_run(run, world=2, epochs=EPOCHS)

    # 1. One model: every rank's state after the last round is model.pt, bit for bit.
    model = torch.load(run / "model.pt", weights_only=True)
    for rank in range(2):
        state = torch.load(states / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(state[key], value) for key, value in model.items()), rank

    # 2. Every batch trained once, each in one round.
    per_epoch = {sum(p["batches"] for p in r["per_rank"]) for r in records}
    assert len(per_epoch) == 1
    rounds = json.loads((run / "timeline.json").read_text())["rounds"]
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
