"""The orchestrators together in one process (tests/helpers/in_process.py): the real Coordinator in rank 0's
host and real SyncWorker / LocalSgdWorker ranks as threads over a loopback store and gloo groups. What the
run records (metrics.jsonl, the timeline, checkpoints, model.pt) is checked against the task's own size, and
each rank's final state against the others'."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.checkpoints.disk import Point, dir_name
from flodl.coordinator import coordinator as coordinator_module
from flodl.data.partition import equal_slices
from flodl.job import rank_threads as rank_module
from flodl.links import stop
from flodl.tasks.digits import digits_dataset
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.nonfinite import NonFiniteError
from tests.helpers.in_process import Fault, InProcessRun, ProcessExit, _one_process, run_in_process

WORLD, EPOCHS, BATCH = 3, 3, 32
TRAIN = len(digits_dataset("train"))


def planned_batches(policy: str, world: int) -> int:
    """The batches of one epoch: local SGD hands out every whole batch, sync equal whole shares per rank."""
    if policy == "sync":
        return equal_slices(TRAIN, world, BATCH)[0].size // BATCH * world
    return TRAIN // BATCH


def assert_one_model(run: InProcessRun) -> None:
    """Every rank ended with the same state, bit for bit, and model.pt is it."""
    model = run.model()
    for end in run.ranks:
        assert end.error is None and end.state is not None, (end.rank, end.error, run.log[-3000:])
        assert set(end.state) == set(model)
        assert all(torch.equal(end.state[k], model[k]) for k in model), end.rank


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_buffer_registered_persistent_false_stays_each_ranks_own(tmp_path: Path, policy: str) -> None:
    """float8's maxima seen: DDP does not broadcast them from rank 0 before each step (every rank would read
    rank 0's), the rounds do not average them (every rank would end with the mean); the model agrees."""
    run = run_in_process(
        tmp_path / "run",
        2,
        f"policy={policy}",
        "epochs=1",
        f"batch_size={BATCH}",
        "task.model._target_=tests.helpers.rank_own.DigitsWithOwnBuffers",
    )
    assert_one_model(run)
    reads = [end.buffers["read"] for end in run.ranks if end.buffers is not None]
    assert len(reads) == 2 and float(reads[0]) != float(reads[1]), reads


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_every_batch_is_trained_once_an_epoch_and_every_rank_ends_with_model_pt(
    tmp_path: Path, policy: str
) -> None:
    run = run_in_process(
        tmp_path / "run",
        WORLD,
        f"policy={policy}",
        f"epochs={EPOCHS}",
        f"batch_size={BATCH}",
        "checkpoint_every=3",
    )
    assert_one_model(run)
    records = run.records
    assert [r["epoch"] for r in records] == list(range(EPOCHS))  # each epoch recorded once, in order
    per_epoch = planned_batches(policy, WORLD)
    for record in records:
        assert len(record["per_rank"]) == WORLD
        assert sum(p["batches"] for p in record["per_rank"]) == per_epoch
        assert record["samples"] == per_epoch * BATCH
        assert "eval/accuracy" in record
    assert records[-1]["eval/accuracy"] > 0.8  # it learned: the digits MLP after 3 epochs, ~0.9
    if policy != "sync":  # every batch counted in exactly one round
        rounds = run.timeline["rounds"]
        assert sum(n for r in rounds for n in r["steps"].values()) == per_epoch * EPOCHS
    manifest = json.loads((run.run_dir / "checkpoints" / "epoch-000003" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(
        ["model.pt", "coordinator.pt"] + [f"rank{r}.pt" for r in range(WORLD)]
    )


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_rank_s_error_ends_the_run_blaming_that_rank(tmp_path: Path, policy: str) -> None:
    """Rank 0 learns of the end by a closed collective or the coordinator, never by a timeout: the test would
    run past its own."""
    run = run_in_process(tmp_path / "run", 2, f"policy={policy}", "epochs=2", faults=(Fault(1, 5),))
    assert run.ranks[1].error == "InjectedFault: rank 1: fault injected at step 5"
    assert run.ranks[0].error is not None  # its peer's end reached it: a closed collective or the coordinator
    blamed = run.blamed()
    assert blamed is not None and blamed.rank == 1, run.log[-3000:]
    assert blamed.cause == "InjectedFault: rank 1: fault injected at step 5"
    assert not (run.run_dir / "model.pt").exists()


def test_a_nan_at_step_k_stops_local_sgd_naming_rank_and_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's loss turns NaN in its second epoch or later (a rank trains at most an epoch's 44 batches in
    the first), while its part of the last checkpoint is still being written (each of its parts is held
    until its next save or the NaN): the rank finishes the part and says so before it goes, so that
    checkpoint is committed, finite."""
    held = threading.Condition()
    saves: dict[Point, int] = {}  # rank 1's parts: their point, the count of its saves then
    nan_found = False
    save, write, found = RankCheckpointer.save, RankCheckpointer._write, NonFiniteError.__init__

    def counted_save(self: RankCheckpointer, point: Point, *args: Any) -> None:
        if self.rank == 1:
            with held:
                saves[point] = len(saves) + 1
                held.notify_all()
        save(self, point, *args)

    def held_write(self: RankCheckpointer, point: Point, *args: Any) -> None:
        if self.rank == 1:
            with held:
                assert held.wait_for(lambda: nan_found or len(saves) > saves[point], 60), "no NaN, no save"
        write(self, point, *args)

    def finding(self: NonFiniteError, *args: Any, **kwargs: Any) -> None:
        nonlocal nan_found
        found(self, *args, **kwargs)
        with held:
            nan_found = True
            held.notify_all()

    monkeypatch.setattr(RankCheckpointer, "save", counted_save)
    monkeypatch.setattr(RankCheckpointer, "_write", held_write)
    monkeypatch.setattr(NonFiniteError, "__init__", finding)
    nan = ("simulate.nan_rank=1", "simulate.nan_at_step=45", "checkpoint_every=1")
    run = run_in_process(tmp_path / "run", 2, "policy=cadence", "epochs=6", *nan)
    blamed = run.blamed()
    assert blamed is not None and blamed.rank == 1 and blamed.step == 45, run.log[-3000:]
    assert "rank 1: the training loss became non-finite (NaN/Inf) at step 45" in blamed.message
    last_saved = max(saves, key=saves.__getitem__)  # its part was in flight when the NaN was found
    assert (run.run_dir / "checkpoints" / "latest").read_text() == dir_name(last_saved)
    latest = run.run_dir / "checkpoints" / dir_name(last_saved)
    state = torch.load(latest / "model.pt", weights_only=True)  # the last good checkpoint stays, finite
    assert all(torch.isfinite(t).all() for t in state.values())


def test_where_flodl_ends_its_process_only_the_rank_s_thread_fails_and_os_exit_stays(tmp_path: Path) -> None:
    """The harness replaces flodl's `end_process` where flodl calls it, not os._exit: a DataLoader worker
    forked during a run ends with os._exit, and so does pytest-timeout's thread on a hung test."""
    exit_process = os._exit
    with _one_process(tmp_path / "in_process.log"):
        assert os._exit is exit_process
        for module in (coordinator_module, rank_module):
            with pytest.raises(ProcessExit):
                module.end_process(1)
    assert coordinator_module.end_process is rank_module.end_process is stop.end_process
