"""Async end to end, checked against what the ranks did: 2 gloo ranks at unequal speeds, the last epoch
running the data out. The last round's consensus is the gamma rule over each rank's last parameters, the
epochs' throughput stays within the ranks' own speeds, and each eval is labelled with the round it ran on.

On both backends: the device backend averages between two steps; the cpu backend's round runs on a thread
while the rank trains on, here with every round held back on purpose (tests/helpers/slow_round), so steps
are surely carried out of each round, the last one before the final round included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flodl.metrics.timeline import read_timeline
from tests.helpers.procs import FAST_START, held_rounds_env, train

pytestmark = pytest.mark.multiproc

GAMMA, BATCH, EPOCHS = 0.5, 128, 5


@pytest.mark.parametrize("backend", ["nccl", "cpu"])
def test_async_last_round_throughput_and_eval_labels(tmp_path: Path, backend: str) -> None:
    record_dir = tmp_path / "params"
    record_dir.mkdir()
    delayed = held_rounds_env(0.2) if backend == "cpu" else {}
    train(
        f"backend={backend}",
        "policy=async",
        "launch.nproc_per_node=2",
        FAST_START,
        # Rank 0 (the coordinator's) is the slow one: its epoch clock is not the other rank's.
        "simulate.slow_rank=0",
        "simulate.factor=3",
        f"gamma={GAMMA}",
        f"batch_size={BATCH}",
        f"epochs={EPOCHS}",
        "eval_every=1",
        # A checkpoint round holds no steps trained while in flight (its part is the consensus): none here.
        "checkpoint_every=null",
        "task.optimizer._target_=tests.helpers.recording.RecordingAdam",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
        FLODL_TEST_RECORD_DIR=str(record_dir),
        **delayed,
    ).check()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = read_timeline(run)["rounds"]

    # 1. model.pt is the gamma-weighted consensus of the parameters each rank brought to the last round,
    # weighed by the steps it took since the round before.
    last = rounds[-1]["steps"]
    steps = [last["0"], last["1"]]
    assert sum(steps) > 0, f"nobody moved in the last round: {rounds[-1]}"
    weights = [n**GAMMA if n else 0.0 for n in steps]
    weights = [w / sum(weights) for w in weights]
    brought = [torch.load(record_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]
    model = torch.load(run / "model.pt", weights_only=True)
    assert len(model) == len(brought[0])
    for got, mine, theirs in zip(model.values(), *brought, strict=True):
        want = weights[0] * mine + weights[1] * theirs
        assert ((got - want).norm() / want.norm()).item() <= 1e-5
    # Every batch was trained and counted once: the last round holds the run's tail.
    batches = sum(p["batches"] for r in records for p in r["per_rank"])
    assert sum(n for r in rounds for n in r["steps"].values()) == batches

    # 2. Steps trained while a round was in flight: only on the cpu backend, where every round was held back.
    # Which rank still had work in its window when a round began depends on timing (on a loaded machine the
    # fast rank may have spent its overshoot before the round started): some rank did.
    during = [sum(r["per_rank"][rank]["steps_during_averaging"] for r in records) for rank in range(2)]
    if backend == "cpu":
        assert sum(during) > 0, during
    else:
        assert during == [0, 0]

    # 3. No epoch's throughput beats what the ranks' own clocks allow.
    for record in records:
        assert record["samples_per_s"] <= sum(p["samples_per_s"] for p in record["per_rank"]) * (1 + 1e-9)

    # 4. One eval per epoch (eval_every=1), labelled with the steps and samples of the round it ran on.
    assert [r["epoch"] for r in records if "eval/accuracy" in r] == list(range(EPOCHS))
    samples_per_epoch = records[0]["samples"]
    trained = 0
    evaluated = {}
    for entry in rounds:
        trained += sum(entry["steps"].values())
        for epoch in entry["evaluates"]:
            evaluated[epoch] = trained
    assert sorted(evaluated) == list(range(EPOCHS))
    for record in records:
        epoch = record["epoch"]
        assert record["eval_step"] == evaluated[epoch]
        assert record["eval_samples"] == evaluated[epoch] * BATCH
        # The round came after the epoch's last batch: the consensus has seen every epoch up to it.
        assert record["eval_samples"] >= (epoch + 1) * samples_per_epoch
