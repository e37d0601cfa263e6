"""The coordinator's side of a checkpoint: commit a point once every rank wrote its part.

A checkpoint is taken where every rank holds the same consensus: after a sync step (at an epoch's end, or
inside it by steps), or after the exact reduce that ends a local-SGD segment (at an epoch's end, or inside
it by steps or time). Each rank writes its part (flodl/worker/checkpoint_part.py) and says so; the
coordinator, once every part is on disk and the epochs before the point are emitted, writes its own state
and commits (see flodl/checkpoints/disk.py). Inside an epoch its state holds what the epoch's record has so
far (the ledger's chunks up to the point), so a resumed run writes the same record. With a rank cut, the parts
are the members' at the checkpoint round. The commit itself (the coordinator's file, every part read back for
the manifest's CRCs, the disk synced) runs on a thread of its own, one at a time and in order: on the
coordinator's thread the next round would wait for it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl.checkpoints.disk import COORDINATOR_FILE, Checkpoint, CheckpointDir, Point, atomic_save
from flodl.config.layout import Layout
from flodl.coordinator.ledger import EpochLedger

log = logging.getLogger("flodl")


HANG_MODEL_FILE = "model-at-hang.pt"


def consensus_saver(model: nn.Module, device: torch.device, path: Path) -> Callable[[], None]:
    """Under sync, rank 0's parameters are the consensus: a silent peer holds the next gradient all-reduce
    open, so no optimizer step can change them any more. The copy runs on a CUDA stream of its own, because
    the training stream waits for that all-reduce forever."""

    def save() -> None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            state = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
        atomic_save(state, path)
        log.error("rank 0's parameters at the hang (the consensus, policy=sync) saved to %s", path)

    return save


def run_kind(policy: str, local_sgd: bool) -> dict[str, Any]:
    return {"policy": policy, "local_sgd": local_sgd}


@dataclass
class CheckpointCommitter:
    """The coordinator's side: commit a point's checkpoint once every rank saved and what comes before it
    is emitted."""

    store: CheckpointDir
    world_size: int
    # Epochs whose end's checkpoint is still to be committed: the run is not over before they are.
    remaining: set[int]
    # What the driver's state means: the policy, and whether it averages in local-SGD rounds.
    kind: dict[str, Any]
    # Who wrote it, for the manifest (flodl/checkpoints/identity.py): resume=auto resumes only its own run.
    run: dict[str, Any]
    # The world the run is laid out for (flodl/config/layout.py), recorded in each checkpoint as its
    # members' (a resume with keep_global_batch keeps its global batch; None: not recorded).
    layout: Layout | None = None
    # Per point, the ranks that saved their part, and how many chunks of the point's epoch each had
    # reported by then (a rank reports its chunks before it says it saved: those are the point's).
    saved: dict[Point, dict[int, int]] = field(default_factory=dict)
    driver_state: dict[Point, dict[str, Any]] = field(default_factory=dict)
    # Per point inside an epoch whose parts are all saved: what the epoch's record holds up to it (the
    # ledger's entry then, before any later round adds to it).
    ledger_state: dict[Point, dict[str, Any]] = field(default_factory=dict)
    committed: Checkpoint | None = None
    # Per point, the ranks whose parts its checkpoint waits for (absent: every rank).
    expected: dict[Point, frozenset[int]] = field(default_factory=dict)
    # Called on the commit thread once a commit is done (the coordinator wakes to take it in at once).
    on_sealed: Callable[[], None] | None = None
    # A stop that saves: the point of its own checkpoint once known (None before; `_stop_asked`: requested).
    # A checkpoint taken before the request and committed after it is not the stop's.
    stop_point: Point | None = field(default=None, init=False)
    _stop_asked: bool = field(default=False, init=False)
    # Commits handed to the commit thread, oldest first, until `poll` takes them in.
    _sealing: deque[tuple[Point, Future[Checkpoint]]] = field(default_factory=deque, init=False)
    _sealer: ThreadPoolExecutor | None = field(default=None, init=False)

    @property
    def writing(self) -> bool:
        """Whether a checkpoint taken is not on disk yet: a rank still writes its part (its Saved is not in)
        or its commit is still to finish."""
        taken = {*self.expected, *self.saved}
        return bool(self._sealing) or any(not self._parts(p) <= self.saved.get(p, {}).keys() for p in taken)

    @property
    def sealing(self) -> bool:
        """Whether a commit is still to finish (or to be taken in by `poll`)."""
        return bool(self._sealing)

    def expect_parts(
        self, point: Point, ranks: Collection[int], driver_state: dict[str, Any] | None = None
    ) -> None:
        """The point's checkpoint holds the parts of `ranks`: the members at its checkpoint round.
        `driver_state`: the driver's state at the point, when the driver knows it ahead (sync)."""
        self.expected[point] = frozenset(ranks)
        if driver_state is not None:
            self.driver_state[point] = driver_state

    def cut(self, ranks: Collection[int]) -> None:
        """Sync: `ranks` left the run. A checkpoint not yet committed holds the parts of the members left
        (they hold one state at its point): a cut rank's part may never come, and its epoch, already
        emitted, is not asked again."""
        for point, expected in self.expected.items():
            self.expected[point] = expected - frozenset(ranks)

    def stop_requested(self) -> None:
        """A stop that saves was asked: from now on the checkpoint it waits for is its own (`stop_saved`):
        under local SGD the first one taken after the request, under sync the one at the step the ranks
        agreed on (every one they took on the way there is committed before it)."""
        self._stop_asked = True

    @property
    def stop_saved(self) -> bool:
        """The stop's own checkpoint (or a later one) is committed."""
        stop, committed = self.stop_point, self.committed
        return stop is not None and committed is not None and committed.point.order >= stop.order

    def _stop_takes(self, point: Point) -> None:
        if self._stop_asked and (self.stop_point is None or point.order > self.stop_point.order):
            self.stop_point = point

    def on_saved(
        self, point: Point, rank: int, chunks: int, ledger: EpochLedger, after_stop: bool = False
    ) -> None:
        """`rank`'s part is on disk; it had reported `chunks` chunks of the point's epoch before it.
        `after_stop`: the stop that saves may end at it (`Saved.after_stop`: under sync the agreed step's
        alone, so the planned ones on the way there are committed before the stop ends)."""
        if after_stop:
            self._stop_takes(point)
        if point.into is not None and point not in self.ledger_state and not ledger.holds(point.epoch):
            self._abandon(point, "its epoch's record was gone before every part was on disk")
            return
        saved = self.saved.setdefault(point, {})
        saved[rank] = chunks
        if point.into is not None and self._parts(point) <= saved.keys():  # the epoch's record up to it
            self.ledger_state.setdefault(point, ledger.partial(point.epoch, saved))

    def on_checkpoint_round(self, point: Point, driver_state: dict[str, Any], ledger: EpochLedger) -> None:
        """Local SGD: the checkpoint round is acknowledged (and no window after it is open): the driver's
        state then, and the epoch's record (every chunk before the point is in, no later one; a sharded
        group's that left inside the epoch too, and the batches lost with it)."""
        self.driver_state[point] = driver_state
        if self.stop_point is None:  # the first checkpoint round after a stop's request ends its segment
            self._stop_takes(point)
        if point.into is not None:  # the members' chunks, and a rank's cut before the point (they stand)
            self.ledger_state[point] = ledger.partial(point.epoch)

    def _abandon(self, point: Point, why: str) -> None:
        """The checkpoint at `point` will not be committed (a later one will be)."""
        if point in self.saved or point in self.expected:
            log.warning("the checkpoint at %s is not taken: %s", point.words(), why)
        for records in (self.saved, self.expected, self.driver_state, self.ledger_state):
            records.pop(point, None)

    def poll(self, ledger: EpochLedger, wait_sealed: bool = False) -> list[Checkpoint]:
        """Hand every point whose parts are all on disk, whose driver state is known and whose epochs before
        it the ledger has emitted (its own too, at an epoch's end) to the commit thread; return the
        checkpoints committed since the last poll, in order (`wait_sealed`: after waiting for every commit
        handed over). A commit that failed raises here."""
        for point in sorted(self.saved, key=lambda p: p.order):
            ranks = self._parts(point)
            if not ranks <= self.saved[point].keys() or point not in self.driver_state:
                continue
            if ledger.next_to_emit <= point.last_whole_epoch:
                continue
            state = {
                **self.kind,
                "layout": None if self.layout is None else self.layout.at(len(ranks)).state(),
                "epoch": point.epoch,
                "into": point.into,
                # Through the last whole epoch: a point inside the next one holds its epoch's bytes so far.
                "comm_bytes_total": ledger.comm_bytes_after(point.last_whole_epoch),
                "driver": self.driver_state.pop(point),
                # Inside an epoch: what its record holds so far (a resumed run starts its ledger there).
                "ledger": self.ledger_state.pop(point, None),
            }
            del self.saved[point]
            self.expected.pop(point, None)
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(1, "flodl-commit")
            sealed = self._sealer.submit(self._seal, point, state, ranks)
            if self.on_sealed is not None:
                sealed.add_done_callback(_calling(self.on_sealed))
            self._sealing.append((point, sealed))
        if wait_sealed:
            wait([sealed for _, sealed in self._sealing])
        committed = []
        while self._sealing and self._sealing[0][1].done():
            point, sealed = self._sealing.popleft()
            self.committed = sealed.result()
            if point.into is None:
                self.remaining.discard(point.epoch)
            committed.append(self.committed)
            log.info("checkpoint %s: %s", point.words(), self.committed.path)
        return committed

    def _seal(self, point: Point, state: dict[str, Any], ranks: frozenset[int]) -> Checkpoint:
        self.store.write_part(point, COORDINATOR_FILE, state)
        # A job that grew past its start holds more ranks than it started with: its checkpoint says so.
        return self.store.commit(point, max(self.world_size, len(ranks)), self.run, ranks)

    def close(self) -> None:
        """Let a commit in flight finish (the run is over or failed)."""
        if self._sealer is not None:
            self._sealer.shutdown(wait=True)

    def _parts(self, point: Point) -> frozenset[int]:
        return self.expected.get(point, frozenset(range(self.world_size)))


def _calling(wake: Callable[[], None]) -> Callable[[Future[Checkpoint]], None]:
    return lambda _: wake()
