"""Checkpoint files on disk: only complete, intact checkpoints are ever picked to resume from."""

from __future__ import annotations

import contextvars
import fcntl
import functools
import io
import json
import logging
import os
import signal
import struct
import sys
import termios
import threading
import zipfile
from pathlib import Path

import psutil
import pytest
import torch

from flodl.checkpoints.disk import (
    COORDINATOR_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    Checkpoint,
    CheckpointDir,
    CheckpointError,
    Point,
    rank_file,
    resolve_resume,
)
from flodl.coordinator.commit import CheckpointCommitter, run_kind
from flodl.coordinator.ledger import EpochLedger
from flodl.job.resume import restore_worker, truncate_history
from flodl.links.messages import ChunkReport, Saved
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.host_snapshot import HostSnapshot, carve, fill
from flodl.worker.rank_state import rng_state, set_rng_state
from tests.helpers.digits_stepper import digits_stepper, train_steps
from tests.helpers.procs import kill_group, start, wait_for, wait_for_path


def write_checkpoint(store: CheckpointDir, epoch: int, world_size: int = 2, commit: bool = True) -> None:
    store.write_part(Point(epoch), MODEL_FILE, {"w": torch.full((64,), float(epoch))})
    store.write_part(Point(epoch), COORDINATOR_FILE, {"epoch": epoch})
    for rank in range(world_size):
        store.write_part(Point(epoch), rank_file(rank), {"rank": rank, "epoch": epoch})
    if commit:
        store.commit(Point(epoch), world_size)


def test_a_committed_checkpoint_is_latest_and_loads_with_weights_only(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    write_checkpoint(store, 1)
    found = store.latest()
    assert found is not None and (found.epoch, found.world_size) == (1, 2)
    assert torch.equal(found.load(MODEL_FILE)["w"], torch.full((64,), 1.0))
    assert (store.root / LATEST_FILE).read_text() == found.path.name


def test_a_part_is_written_without_torch_s_record_checksums_and_leaves_its_thread_s_context_as_it_was(
    tmp_path: Path,
) -> None:
    """The manifest holds each part's CRC-32, so torch's own per record is off; torch turns it off through a
    ContextVar it sets anew at each call, which a writer thread kept for good (~220 B per save)."""
    store = CheckpointDir(tmp_path, keep=2)
    before = len(contextvars.copy_context())
    for point in range(3):
        write_checkpoint(store, point)
    assert len(contextvars.copy_context()) == before
    found = store.latest()
    assert found is not None
    model = found.path / MODEL_FILE
    with zipfile.ZipFile(model) as archive:
        assert [info.CRC for info in archive.infolist() if "/data/" in info.filename] == [0]
    assert torch.equal(torch.load(model, weights_only=True)["w"], torch.full((64,), 2.0))


def test_a_checkpoint_interrupted_mid_write_is_never_latest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2, commit=False)  # the ranks wrote their parts, the commit never happened
    assert store.latest().epoch == 1


def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2)
    victim = store.root / "epoch-000003" / rank_file(1)  # after epoch 3, as lines count
    victim.write_bytes(victim.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="flodl"):
        found = store.latest()
    assert found is not None and found.epoch == 1
    assert "rank1.pt does not match its manifest" in caplog.text
    # Asked for by path, the damaged checkpoint is refused with the reason.
    with pytest.raises(CheckpointError, match=r"rank1\.pt does not match"):
        resolve_resume(str(store.root / "epoch-000003"), store)


@pytest.mark.parametrize("unlisted", [[MODEL_FILE, COORDINATOR_FILE, "rank0.pt", "rank1.pt"], ["rank1.pt"]])
def test_a_checkpoint_whose_manifest_does_not_list_every_part_is_incomplete_and_never_picked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, unlisted: list[str]
) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2)
    newest = store.root / "epoch-000003"  # epoch index 2: after epoch 3, as lines count
    manifest = json.loads((newest / MANIFEST_FILE).read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if k not in unlisted}
    (newest / MANIFEST_FILE).write_text(json.dumps(manifest))
    (newest / unlisted[0]).unlink()  # what a manifest does not list is not checked: it may be gone
    with caplog.at_level(logging.WARNING, logger="flodl"):
        found = store.latest()
    assert found is not None and found.epoch == 1  # the one before, and the log says why
    assert f"skipping checkpoint {newest}: {MANIFEST_FILE} does not list {unlisted[0]}" in caplog.text
    with pytest.raises(CheckpointError, match=rf"does not list {unlisted[0]}"):
        resolve_resume(str(newest), store)


def test_commit_refuses_a_checkpoint_with_a_missing_part(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    store.write_part(Point(3), MODEL_FILE, {})
    store.write_part(Point(3), COORDINATOR_FILE, {})
    store.write_part(Point(3), rank_file(0), {})
    with pytest.raises(CheckpointError, match=r"parts missing: rank1\.pt"):
        store.commit(Point(3), world_size=2)
    assert store.latest() is None


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    for epoch in range(4):
        write_checkpoint(store, epoch)
    # Named by the epochs they hold: the checkpoints after the third and the fourth epoch.
    assert sorted(p.name for p in store.root.iterdir() if p.is_dir()) == ["epoch-000003", "epoch-000004"]


def test_resume_choices(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path / "run", keep=2)
    assert resolve_resume("auto", store) is None  # a fresh run
    write_checkpoint(store, 4)
    assert resolve_resume("auto", store).epoch == 4
    assert resolve_resume("never", store) is None
    other = CheckpointDir(tmp_path / "elsewhere", keep=2)
    assert resolve_resume(str(tmp_path / "run"), other).epoch == 4  # a run dir
    assert resolve_resume(str(store.root), other).epoch == 4  # its checkpoints/ dir
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "elsewhere"), other)


def test_history_after_the_checkpoint_is_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "loss": 1.0 / (e + 1)}) + "\n" for e in range(5)))
    truncate_history(path, through_epoch=2)
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [0, 1, 2]


# --- members (fault_tolerance=survive): a checkpoint holds the parts of the members at its round -----


def test_a_checkpoint_holds_the_parts_of_the_members_at_its_round(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    store.write_part(Point(2), MODEL_FILE, {})
    store.write_part(Point(2), COORDINATOR_FILE, {})
    store.write_part(Point(2), rank_file(0), {})
    with pytest.raises(CheckpointError, match=r"parts missing: rank2\.pt"):
        store.commit(Point(2), world_size=3, ranks={0, 2})
    store.write_part(Point(2), rank_file(2), {})
    committed = store.commit(Point(2), world_size=3, ranks={2, 0})
    found = store.latest()
    assert found == committed and found.part_ranks == (0, 2) and found.world_size == 3
    assert json.loads((found.path / "manifest.json").read_text())["ranks"] == [0, 2]
    write_checkpoint(store, 3, world_size=3)  # nobody cut: every rank's part
    assert store.latest().part_ranks == (0, 1, 2)


def test_a_manifest_without_ranks_holds_every_rank_s_part(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    write_checkpoint(store, 1)
    manifest = store.latest().path / "manifest.json"
    older = json.loads(manifest.read_text())
    del older["ranks"]
    manifest.write_text(json.dumps(older))
    assert store.latest().part_ranks == (0, 1)


def _emitted_ledger(epochs: int, world_size: int) -> EpochLedger:
    """A ledger that has emitted epoch 0 (a checkpoint commits only once its epoch is)."""
    ledger = EpochLedger(epochs=epochs, world_size=world_size, batches_per_epoch=world_size)
    for rank in range(world_size):
        ledger.add_chunk(ChunkReport(rank, 0, 1, 4, 1.0, 10.0, 1.0))
    ledger.expect_eval(0, False)
    assert len(ledger.emit_ready()) == 1
    return ledger


def _write_parts(store: CheckpointDir, epoch: int, ranks: list[int]) -> None:
    store.write_part(Point(epoch), MODEL_FILE, {})
    for rank in ranks:
        store.write_part(Point(epoch), rank_file(rank), {"worker": {}})


def test_the_committer_waits_for_the_members_at_the_checkpoint_round(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    ledger = _emitted_ledger(epochs=3, world_size=3)
    committer = CheckpointCommitter(store, 3, {0}, run_kind("cadence", True), {"uid": "u"})
    committer.expect_parts(Point(0), {0, 2})  # rank 1 was cut before the checkpoint round
    _write_parts(store, 0, [0, 2])
    committer.on_saved(Point(0), 0, 1, ledger)
    committer.on_saved(Point(0), 2, 1, ledger)
    assert committer.poll(ledger, wait_sealed=True) == []  # the checkpoint round is not acknowledged yet
    committer.on_checkpoint_round(Point(0), {"elche": None}, ledger)
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.part_ranks == (0, 2) and committer.remaining == set()


def test_the_committer_waits_for_every_rank_unless_told_otherwise(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    ledger = _emitted_ledger(epochs=3, world_size=2)
    committer = CheckpointCommitter(store, 2, {0}, run_kind("sync", False), {"uid": "u"})
    committer.expect_parts(Point(0), range(2), {})
    _write_parts(store, 0, [0, 1])
    committer.on_saved(Point(0), 0, 1, ledger)
    assert committer.poll(ledger, wait_sealed=True) == []
    committer.on_saved(Point(0), 1, 1, ledger)
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.part_ranks == (0, 1)


def test_a_local_sgd_checkpoint_round_acknowledged_by_the_members_commits_their_parts(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    ledger = _emitted_ledger(epochs=3, world_size=3)
    committer = CheckpointCommitter(store, 3, {0}, run_kind("async", True), {"uid": "u"})
    assert not committer.writing
    committer.expect_parts(Point(0), [0, 1])
    _write_parts(store, 0, [0, 1])
    committer.on_checkpoint_round(Point(0), {"planner": {}}, ledger)
    committer.on_saved(Point(0), 1, 1, ledger)
    assert committer.poll(ledger, wait_sealed=True) == []  # rank 0's part is still being written
    assert committer.writing  # so no checkpoint by time is taken: rank 0 would wait for this one
    committer.on_saved(Point(0), 0, 1, ledger)
    assert not committer.writing  # every part on disk, the commit still to come: the next may be taken
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    assert checkpoint.part_ranks == (0, 1)
    assert checkpoint.load(COORDINATOR_FILE)["driver"] == {"planner": {}}


class _HeldCommits(CheckpointDir):
    """A checkpoint dir whose commits wait until the test lets them go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, keep=3)
        self.release = threading.Event()
        self.committing = threading.Event()

    def commit(self, *args: object, **kwargs: object) -> Checkpoint:
        self.committing.set()
        assert self.release.wait(30), "the test never let the commit go"
        return super().commit(*args, **kwargs)  # type: ignore[arg-type]


def test_a_commit_runs_off_the_coordinator_s_thread_and_wakes_it_when_done(tmp_path: Path) -> None:
    """The commit (every part read back for its CRC, the disk synced) must not hold the coordinator's loop,
    or the next round waits for it."""
    store = _HeldCommits(tmp_path)
    ledger = _emitted_ledger(epochs=3, world_size=1)
    woken = threading.Event()
    committer = CheckpointCommitter(store, 1, {0}, run_kind("sync", False), {"uid": "u"}, on_sealed=woken.set)
    committer.expect_parts(Point(0), [0], {})
    _write_parts(store, 0, [0])
    committer.on_saved(Point(0), 0, 1, ledger)
    assert committer.poll(ledger) == []  # handed over, not waited for
    assert store.committing.wait(30) and committer.writing and committer.sealing
    assert store.latest() is None and committer.remaining == {0}
    store.release.set()
    assert woken.wait(30)
    (checkpoint,) = committer.poll(ledger)
    assert checkpoint.epoch == 0 and store.latest() == checkpoint
    assert committer.remaining == set() and not committer.writing and not committer.sealing
    committer.close()


class _Worker:
    """What restore_worker uses of a worker: its rank, its stepper, restore(), what it takes of another
    rank's state, whether the ranks share one optimizer state (sync)."""

    def __init__(self, rank: int, stepper: object, shares_optimizer: bool = False) -> None:
        self.rank = rank
        self.stepper = stepper
        self.shares_optimizer = shares_optimizer
        self.restored: dict | None = None

    def restore(self, state: dict) -> None:
        self.restored = state

    def shared_state(self, state: dict) -> dict:
        return {key: value for key, value in state.items() if key != "own"}


def _moments(stepper: object) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in stepper.parts.optimizer.state_dict()["state"].values()]


def test_a_rank_without_a_part_resumes_from_the_consensus_with_a_saved_ranks_optimizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    writers = [digits_stepper(), digits_stepper()]
    for steps, writer in zip((3, 5), writers, strict=True):
        train_steps(writer, steps)
    for rank, writer in enumerate(writers):
        checkpointer = RankCheckpointer(store, rank, writer.parts.model, writer)
        checkpointer.save(Point(4), {"global_steps": 9, "own": rank}, Saved(rank, 4), first_member=rank == 0)
    store.write_part(Point(4), COORDINATOR_FILE, {})
    checkpoint = store.commit(Point(4), world_size=2, ranks={0, 1})

    member = _Worker(0, digits_stepper())
    with caplog.at_level(logging.INFO, logger="flodl"):
        restore_worker(checkpoint, member, world_size=2)
    assert member.restored == {"global_steps": 9, "own": 0} and member.stepper.steps_total == 3
    # Counted as every line counts, from 1: the checkpoint after the fifth epoch, the sixth next.
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith("checkpoints/epoch-000005: training continues at epoch 6"), line
    caplog.clear()

    # Resumed on 5 ranks under local SGD: rank r takes saved rank r mod 2's optimizer, not its own state.
    for rank in (2, 3):
        fresh = digits_stepper()
        grown = _Worker(rank, fresh)
        rng_before = torch.get_rng_state()
        with caplog.at_level(logging.INFO, logger="flodl"):
            restore_worker(checkpoint, grown, world_size=5)
        source = writers[rank % 2]
        assert grown.restored == {"global_steps": 9}  # the shared state, not rank r mod 2's own
        assert fresh.steps_total == source.steps_total
        assert all(map(torch.equal, _moments(fresh), _moments(source)))
        assert torch.equal(torch.get_rng_state(), rng_before)  # its RNG streams stay its own
        (line,) = [r.getMessage() for r in caplog.records]
        assert f"rank {rank} has no part" in line and f"rank {rank % 2}'s optimizer state" in line
        caplog.clear()

    # Under sync every rank steps one optimizer state: a rank without a part takes the first part's.
    synced = digits_stepper()
    restore_worker(checkpoint, _Worker(2, synced, shares_optimizer=True), world_size=3)
    assert synced.steps_total == 3
    assert all(map(torch.equal, _moments(synced), _moments(writers[0])))


def test_a_part_written_in_the_background_is_the_state_at_the_boundary_and_said_once_on_disk(
    tmp_path: Path,
) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    stepper = digits_stepper()
    train_steps(stepper, 3)
    at_boundary = {k: v.clone() for k, v in stepper.parts.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in stepper.parts.optimizer.state_dict()["state"].values()]
    trained_on = threading.Event()
    write_part = store.write_part

    def write_after_training(*args: object) -> None:  # the writer thread holds off until training went on
        assert trained_on.wait(60)
        write_part(*args)  # type: ignore[arg-type]

    store.write_part = write_after_training  # type: ignore[method-assign]
    checkpointer = RankCheckpointer(store, 0, stepper.parts.model, stepper, background=True)
    receipt = Saved(0, 1, into=96, chunks=1)
    checkpointer.save(Point(1, 96), {"global_steps": 3}, receipt)
    train_steps(stepper, 2)  # training goes on while the part is written
    assert checkpointer.written() == []  # not on disk yet: nothing to say
    trained_on.set()
    checkpointer.flush()
    assert checkpointer.written() == [receipt] and checkpointer.written() == []
    checkpointer.close()
    part = torch.load(store.partial(Point(1, 96)) / rank_file(0), weights_only=True)
    model = torch.load(store.partial(Point(1, 96)) / MODEL_FILE, weights_only=True)
    # What was written is the state at the save, not the state the two later steps made.
    assert all(torch.equal(model[k], at_boundary[k]) for k in at_boundary)
    written = [s["exp_avg"] for s in part["stepper"]["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(written, moments, strict=True))
    assert part["stepper"]["steps_total"] == 3 and part["worker"] == {"global_steps": 3}


def test_a_part_written_in_the_background_wakes_its_worker(tmp_path: Path) -> None:
    """An idle worker waits for its next message: the writer wakes it once the part is on disk, so its Saved
    goes out then (the run's last checkpoint had waited out the worker's whole wait, half a second)."""
    stepper = digits_stepper()
    train_steps(stepper, 1)
    checkpointer = RankCheckpointer(
        CheckpointDir(tmp_path, keep=1), 0, stepper.parts.model, stepper, background=True
    )
    woken = threading.Event()
    checkpointer.on_written = woken.set
    receipt = Saved(0, 0, into=32, chunks=1)
    checkpointer.save(Point(0, 32), {}, receipt)
    assert woken.wait(60), "the writer did not wake the worker"
    assert checkpointer.written() == [receipt]
    checkpointer.close()


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_snapshot_copies_into_buffers_it_keeps_and_saves_a_view_without_its_storage(shared: bool) -> None:
    flat = torch.arange(12.0)
    state = {"weight": flat[4:8], "optimizer": [{"step": torch.tensor(3)}], "name": "kept as is"}
    snapshot = HostSnapshot(shared=shared)
    first = snapshot.take(state)
    assert first.ready == []  # nothing on a device to wait for
    assert first.region.bytes.is_shared() == shared  # a writer process maps it
    flat.add_(100.0)  # training goes on writing into its own tensors
    weight = first.value["weight"]
    assert torch.equal(weight, torch.arange(4.0, 8.0)) and first.value["name"] == "kept as is"
    assert first.value["optimizer"][0]["step"].dtype == torch.int64
    # A buffer of its own, not a view: torch.save would write the whole storage behind a view.
    assert weight.untyped_storage().nbytes() == 4 * 4
    saved = io.BytesIO()
    torch.save(first.value, saved)
    assert len(saved.getvalue()) < 2000  # the 16 bytes of the weight, not the region's
    # What a writer process rebuilds from the structure and its own mapping of the region is the same state.
    rebuilt = fill(first.skeleton, functools.partial(carve, first.region.bytes.clone()))
    assert torch.equal(rebuilt["weight"], weight) and rebuilt["optimizer"][0]["step"].item() == 3
    again = snapshot.take(state)
    # The next save copies into the same buffers (no allocation, no pinning again).
    assert again.value["weight"].data_ptr() == weight.data_ptr() and again.region is first.region
    assert torch.equal(again.value["weight"], torch.arange(104.0, 108.0))
    state["weight"] = torch.zeros(2, 2)  # a tensor whose shape changed: a new region
    changed = snapshot.take(state)
    assert changed.value["weight"].shape == (2, 2) and changed.region is not first.region
    snapshot.release()


def test_the_rng_streams_come_back_from_a_part_and_python_s_from_an_older_part_s_list() -> None:
    import random

    import numpy as np

    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    state = rng_state(torch.device("cpu"))
    # A handful of tensors, not 625 ints: a save walks the state leaf by leaf on the training thread.
    assert isinstance(state["python"][0], torch.Tensor)
    saved = io.BytesIO()
    torch.save(state, saved)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(torch.load(io.BytesIO(saved.getvalue()), weights_only=True), torch.device("cpu"))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    older = {**state, "python": [state["python"][0].tolist(), state["python"][1]]}
    random.seed(0)
    set_rng_state(older, torch.device("cpu"))
    assert random.random() == expected[0]


@pytest.mark.multiproc
def test_a_writer_process_writes_the_parts_ignores_stop_signals_and_its_loss_falls_back_to_a_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The process a GPU rank writes its parts with (made to write a CPU rank's here): what it writes is the
    state at the boundary; a stop signal (Ctrl-C reaches the whole process group) leaves it writing the stop's
    checkpoint; if it is gone (killed for memory), the rank writes on its own thread and says so."""
    store = CheckpointDir(tmp_path, keep=3)
    stepper = digits_stepper()
    train_steps(stepper, 2)
    checkpointer = RankCheckpointer(
        store, 0, stepper.parts.model, stepper, background=True, writer_process=True
    )
    assert checkpointer.writes_in_process
    process = checkpointer._process._process  # type: ignore[union-attr]
    checkpointer.wait_ready()  # what a worker does before it trains: the process's imports are done
    if hasattr(os, "SCHED_IDLE"):  # it only takes cores training leaves idle
        assert os.sched_getscheduler(process.pid) == os.SCHED_IDLE
    points = [Point(0, 64), Point(0, 128), Point(0, 192)]
    states = []
    for i, point in enumerate(points):
        if i == 1:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                os.kill(process.pid, signum)
        if i == 2:
            process.kill()
            process.join(30)
        states.append({k: v.clone() for k, v in stepper.parts.model.state_dict().items()})
        with caplog.at_level("WARNING", logger="flodl"):
            checkpointer.save(point, {"at": i}, Saved(0, 0, into=point.into, chunks=i))
            train_steps(stepper, 1)  # after the copy: not in the part
            checkpointer.flush()
    assert [r.into for r in checkpointer.written()] == [64, 128, 192]
    assert not checkpointer.writes_in_process
    assert "the checkpoint writer process ended (exit code -9)" in caplog.text
    checkpointer.close()
    for point, state in zip(points, states, strict=True):
        model = torch.load(store.partial(point) / MODEL_FILE, weights_only=True)
        assert all(torch.equal(model[k], state[k]) for k in state)
    part = torch.load(store.partial(points[1]) / rank_file(0), weights_only=True)
    assert part["worker"] == {"at": 1} and part["stepper"]["steps_total"] == 3


@pytest.mark.multiproc
def test_a_writer_process_gone_before_it_started_leaves_the_rank_writing_on_a_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stepper = digits_stepper()
    checkpointer = RankCheckpointer(
        CheckpointDir(tmp_path, keep=1), 0, stepper.parts.model, stepper, background=True, writer_process=True
    )
    process = checkpointer._process._process  # type: ignore[union-attr]
    process.kill()
    process.join(30)
    with caplog.at_level("WARNING", logger="flodl"):
        checkpointer.wait_ready()
    assert not checkpointer.writes_in_process
    assert "the checkpoint writer process ended (exit code -9) as it started" in caplog.text
    checkpointer.save(Point(0, 32), {}, Saved(0, 0, into=32, chunks=0))
    checkpointer.flush()
    assert [r.into for r in checkpointer.written()] == [32]
    checkpointer.close()


@pytest.mark.multiproc
def test_no_room_in_shared_memory_for_a_writer_process_falls_back_to_a_thread_and_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A container's /dev/shm is often 64 MB, less than a model's state: the save must not fail for it."""
    store = CheckpointDir(tmp_path, keep=3)
    stepper = digits_stepper()
    train_steps(stepper, 1)
    model = stepper.parts.model
    checkpointer = RankCheckpointer(store, 0, model, stepper, background=True, writer_process=True)

    def no_room(self: torch.Tensor) -> torch.Tensor:  # what torch raises when /dev/shm is full
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1>: No space left (28)")

    monkeypatch.setattr(torch.Tensor, "share_memory_", no_room)
    at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("WARNING", logger="flodl"):
        checkpointer.save(Point(0, 32), {}, Saved(0, 0, into=32, chunks=1))
    checkpointer.flush()
    assert [r.into for r in checkpointer.written()] == [32] and not checkpointer.writes_in_process
    assert "no room for a copy of" in caplog.text and "docker run --shm-size" in caplog.text
    checkpointer.close()
    written = torch.load(store.partial(Point(0, 32)) / MODEL_FILE, weights_only=True)
    assert all(torch.equal(written[k], at_boundary[k]) for k in at_boundary)


_WRITER_HOST = """
import sys, time
from pathlib import Path
import torch
from flodl.worker.host_snapshot import HostSnapshot
from flodl.worker.part_writer import PartWriterProcess
out = Path(sys.argv[1])
writer = PartWriterProcess(0)
taken = HostSnapshot(shared=True).take({"w": torch.ones(1 << 20)})
writer.write(taken.region, [(out / "first.pt", taken.skeleton)])  # it serves: its death signal is set
(out / "writer.pid").write_text(str(writer._process.pid))
while not (out / "go").exists():
    time.sleep(0.05)
writer.write(taken.region, [(out / "second.pt", taken.skeleton)])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
@pytest.mark.multiproc
def test_a_writer_process_ends_with_its_rank_killed_while_it_writes(tmp_path: Path) -> None:
    """A rank killed outright (SIGKILL: none of its code runs) while its writer process writes a part must not
    leave that process behind, still writing into a checkpoint dir that a resumed run writes again. The part's
    temporary file is a FIFO nobody reads: the process blocks in its write once the FIFO's buffer is full
    (without the death signal it would wait there for ever)."""
    host = start([sys.executable, "-c", _WRITER_HOST, str(tmp_path)], tmp_path)
    reader = None
    try:
        wait_for_path(tmp_path / "writer.pid", host, timeout=120)
        assert torch.equal(torch.load(tmp_path / "first.pt", weights_only=True)["w"], torch.ones(1 << 20))
        writer = psutil.Process(int((tmp_path / "writer.pid").read_text()))
        fifo = tmp_path / f".second.pt.tmp-{writer.pid}"  # flodl.checkpoints.disk's temporary name for it
        os.mkfifo(fifo)
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        (tmp_path / "go").touch()

        def pending() -> int:
            return struct.unpack("i", fcntl.ioctl(reader, termios.FIONREAD, b"\0" * 4))[0]

        # Any byte there: the process is inside the part (4 MiB, far more than the FIFO holds).
        wait_for(lambda: pending() > 0, host, 120, "the writer started the part")
        os.kill(host.pid, signal.SIGKILL)
        host.wait(30)
        gone, _ = psutil.wait_procs([writer], timeout=60)
        assert gone or writer.status() == psutil.STATUS_ZOMBIE, "the writer outlived its rank"
    finally:
        kill_group(host)
        if reader is not None:
            os.close(reader)


@pytest.mark.gpu
@pytest.mark.multiproc  # its part is written by a writer process of its own
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_background_save_on_a_gpu_does_not_wait_for_the_device_and_writes_the_boundary_s_state(
    tmp_path: Path,
) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    stepper = digits_stepper(device="cuda")
    train_steps(stepper, 3)
    at_boundary = {k: v.clone() for k, v in stepper.parts.model.state_dict().items()}
    trained = stepper.parts.model
    checkpointer = RankCheckpointer(store, 0, trained, stepper, background=True, writer_process=True)
    assert checkpointer.writes_in_process
    checkpointer.save(Point(0, 96), {}, Saved(0, 0, into=96, chunks=1))  # the host buffers are made here
    checkpointer.flush()
    torch.cuda.synchronize()
    torch.cuda._sleep(
        2_000_000_000
    )  # the device is busy for a second or so: a save that waited would see it done
    torch.cuda.set_sync_debug_mode("error")  # and any synchronizing call in the save raises
    try:
        checkpointer.save(Point(0, 192), {}, Saved(0, 0, into=192, chunks=2))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.cuda.current_stream().query()  # the save returned while the device was still busy
    with torch.no_grad():
        for parameter in stepper.parts.model.parameters():
            parameter.add_(1.0)  # queued after the copies: the part holds the state at the boundary
    checkpointer.flush()
    checkpointer.close()
    model = torch.load(store.partial(Point(0, 192)) / MODEL_FILE, weights_only=True)
    assert all(torch.equal(model[k], at_boundary[k].cpu()) for k in at_boundary)
