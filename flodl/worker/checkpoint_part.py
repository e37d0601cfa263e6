"""A rank's own part of a checkpoint: written at the boundary (or in the background, from a copy taken
there), said `Saved` once it is on disk, loaded back on resume.

The group's first member also writes the model (every member holds the same consensus at a checkpoint); a
sharded model's ranks write theirs in shards instead, with the rest of their sharded state
(flodl/worker/sharded_state.py), at the boundary.
In the background (`background=True`), the rank's state is copied into host buffers kept from one save to
the next (flodl/worker/host_snapshot.py: the copies queued on the device's stream, so the training thread
does not wait for them); a thread of its own waits for the copies and writes the part, or on a GPU has the
rank's writer process write it (flodl/worker/part_writer.py). One part is in flight at a time (the next save
waits for the last), and the worker reports the `Saved` receipts of the parts written at its next look
(`written`), so the coordinator commits only what is on disk. Files load with `weights_only=True`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import nn

from flodl.checkpoints.disk import MODEL_FILE, CheckpointDir, Point, model_state, rank_file
from flodl.checkpoints.sharded import SHARDED_DIR
from flodl.links.messages import Saved
from flodl.worker.host_snapshot import HostSnapshot, SharedRegionFailed, Taken
from flodl.worker.part_writer import PartWriterProcess, WriterGone
from flodl.worker.rank_state import stepper_state
from flodl.worker.sharded_state import ShardedState
from flodl.worker.stepper import Stepper

log = logging.getLogger("flodl")


class RankCheckpointer:
    """A worker's side: write this rank's part of a checkpoint, then hand back its `Saved` receipt."""

    def __init__(
        self,
        store: CheckpointDir,
        rank: int,
        model: nn.Module,
        stepper: Stepper,
        background: bool = False,
        writer_process: bool = False,
        sharded: ShardedState | None = None,
    ) -> None:
        """`writer_process` (in the background): parts written by a process of the rank's own (what a GPU
        rank does, see flodl/worker/part_writer.py), not by a thread. `sharded`: a sharded model's state,
        written in shards at the boundary."""
        self.store = store
        self.sharded = sharded
        self.rank = rank
        self.model = model
        self.stepper = stepper
        self._writer = ThreadPoolExecutor(1, "flodl-checkpoint") if background else None
        self._process = PartWriterProcess(rank) if background and writer_process else None
        self._snapshot = HostSnapshot(shared=self._process is not None)
        self._in_flight: tuple[Future[None], Saved] | None = None
        self._receipts: list[Saved] = []
        # Seconds the last part took from the boundary until it was on disk (a stop's budget is checked
        # against it); None until one was written.
        self.last_save_s: float | None = None
        # Called on the writer's thread once a part is on disk (the worker wakes to say Saved at once).
        self.on_written: Callable[[], None] | None = None

    def save(
        self, point: Point, worker_state: dict[str, Any], receipt: Saved, first_member: bool = True
    ) -> None:
        """Write the part at `point` (`first_member`: the model too: every member holds the same one here,
        one copy is enough); `receipt` is reported once it is on disk."""
        self.flush()  # one part in flight: a copy of the state at a time, and parts committed in order
        started = time.perf_counter()
        part = {"stepper": stepper_state(self.stepper), "worker": worker_state}
        names = [*([MODEL_FILE] if first_member else []), rank_file(self.rank)]
        if self._writer is None:  # at the boundary (a sharded model's parts always: collectives write them)
            if self.sharded is not None:
                self.sharded.save(self.store.partial(point) / SHARDED_DIR)
                self.store.write_part(point, rank_file(self.rank), part)
            else:
                state = [*([model_state(self.model)] if first_member else []), part]
                for name, obj in zip(names, state, strict=True):
                    self.store.write_part(point, name, obj)
            self.last_save_s = time.perf_counter() - started
            self._receipts.append(receipt)
            return
        state = [*([self.model.state_dict()] if first_member else []), part]
        try:
            taken = self._snapshot.take(state)
        except SharedRegionFailed as failed:
            more = "give the job more shared memory (docker run --shm-size) for a process to write them"
            self._write_on_thread(f"{failed}; {more}")
            taken = self._snapshot.take(state)
        future = self._writer.submit(self._write, point, names, taken, started)
        wake = self.on_written
        if wake is not None:
            future.add_done_callback(lambda _: wake())
        self._in_flight = (future, receipt)

    def _write(self, point: Point, names: list[str], taken: Taken, started: float) -> None:
        for event in taken.ready:  # the device's copies into the host buffers are done
            event.synchronize()
        if self._process is not None:
            paths = [self.store.partial(point) / name for name in names]
            try:
                self._process.write(taken.region, list(zip(paths, taken.skeleton, strict=True)))
                self.last_save_s = time.perf_counter() - started
                return
            except WriterGone as gone:
                self._write_on_thread(str(gone))
        for name, obj in zip(names, taken.value, strict=True):
            self.store.write_part(point, name, obj)
        self.last_save_s = time.perf_counter() - started

    def _write_on_thread(self, why: str) -> None:
        """The writer process cannot write the parts (`why`): this rank's thread does from now on."""
        log.warning("rank %d: %s: its checkpoint parts are written on a thread from now on", self.rank, why)
        assert self._process is not None
        self._process.close()
        self._process = None
        self._snapshot.release()
        self._snapshot = HostSnapshot()

    def wait_ready(self) -> None:
        """Before training: a writer process has started (falls back to the thread if it cannot)."""
        if self._process is None:
            return
        try:
            self._process.wait_ready()
        except WriterGone as gone:
            self._write_on_thread(str(gone))

    @property
    def writes_in_process(self) -> bool:
        """Whether its parts are written by a process of the rank's own (flodl/worker/part_writer.py)."""
        return self._process is not None

    def written(self) -> list[Saved]:
        """The receipts of the parts on disk since the last look (a failed write raises here)."""
        if self._in_flight is not None and self._in_flight[0].done():
            self._finish()
        receipts, self._receipts = self._receipts, []
        return receipts

    def flush(self) -> None:
        """Wait for the part in flight (at a save, and before the rank ends)."""
        if self._in_flight is not None:
            self._finish()

    def _finish(self) -> None:
        assert self._in_flight is not None
        future, receipt = self._in_flight
        self._in_flight = None
        future.result()  # a failed write raises in the rank's own thread, naming its file
        self._receipts.append(receipt)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._process is not None:
            self._process.close()
        self._snapshot.release()
