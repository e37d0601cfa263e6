"""A rank's own part of a checkpoint: written at the boundary (or in the background, from a copy taken
there), said `Saved` once it is on disk, loaded back on resume.

The group's first member also writes the model (every member holds the same consensus at a checkpoint).
In the background (`background=True`), the rank's state is copied into host buffers kept from one save to
the next (pinned for a GPU's tensors, the copies queued on the device's stream, so the training thread does
not wait for them); a thread of its own waits for the copies and writes the part (one part in flight at a
time: the next save waits for the last), and the worker reports the `Saved` receipts of the parts written at
its next look (`written`), so the coordinator commits only what is on disk. Files load with
`weights_only=True`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from flodl.checkpoint import MODEL_FILE, Checkpoint, CheckpointDir, Point, model_state, rank_file
from flodl.wire.messages import Saved
from flodl.worker.rank_state import restore_stepper, stepper_state
from flodl.worker.stepper import Stepper


class HostSnapshot:
    """Host buffers a state is copied into at a boundary (the optimizer goes on writing into its own), kept
    from one save to the next: allocating (and pinning) them again at every save would cost more than the
    copy."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def take(self, obj: Any) -> tuple[Any, list[torch.cuda.Event]]:
        """`obj` with every tensor copied into this snapshot's buffers, and the events its device copies
        finish at (wait for them before reading the copy). The copy of the last `take` is overwritten."""
        taken: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()

        def copy(obj: Any, path: tuple[Any, ...]) -> Any:
            if isinstance(obj, torch.Tensor):
                source = obj.detach()
                buffer = self._buffers.get(path)
                if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                    # A buffer of its own per tensor: a view into a flat buffer would save the whole storage.
                    buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                # From a GPU: queued on its stream, after the step that wrote the tensor and before the next.
                buffer.copy_(source, non_blocking=source.is_cuda)
                if source.is_cuda:
                    devices.add(source.device)
                taken[path] = buffer
                return buffer
            if isinstance(obj, dict):
                return {key: copy(value, (*path, key)) for key, value in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(copy(value, (*path, i)) for i, value in enumerate(obj))
            return obj

        copied = copy(obj, ())
        self._buffers = taken  # buffers of state that is gone are let go
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return copied, events


class RankCheckpointer:
    """A worker's side: write this rank's part of a checkpoint, then hand back its `Saved` receipt."""

    def __init__(
        self, store: CheckpointDir, rank: int, model: nn.Module, stepper: Stepper, background: bool = False
    ) -> None:
        self.store = store
        self.rank = rank
        self.model = model
        self.stepper = stepper
        self._writer = ThreadPoolExecutor(1, "flodl-checkpoint") if background else None
        self._snapshot = HostSnapshot()
        self._in_flight: tuple[Future[None], Saved] | None = None
        self._receipts: list[Saved] = []
        # Seconds the last part took from the boundary until it was on disk (a stop's budget is checked
        # against it); None until one was written.
        self.last_save_s: float | None = None

    def save(
        self, point: Point, worker_state: dict[str, Any], receipt: Saved, first_member: bool = True
    ) -> None:
        """Write the part at `point` (`first_member`: the model too: every member holds the same one here,
        one copy is enough); `receipt` is reported once it is on disk."""
        self.flush()  # one part in flight: a copy of the state at a time, and parts committed in order
        started = time.perf_counter()
        part = {"stepper": stepper_state(self.stepper), "worker": worker_state}
        if self._writer is None:
            self._write(point, part, model_state(self.model) if first_member else None, started, [])
            self._receipts.append(receipt)
            return
        model = self.model.state_dict() if first_member else None
        (part, model), ready = self._snapshot.take((part, model))
        self._in_flight = (self._writer.submit(self._write, point, part, model, started, ready), receipt)

    def _write(
        self,
        point: Point,
        part: dict[str, Any],
        model: dict[str, torch.Tensor] | None,
        started: float,
        ready: list[torch.cuda.Event],
    ) -> None:
        for event in ready:  # the device's copies into the host buffers are done
            event.synchronize()
        if model is not None:
            self.store.write_part(point, MODEL_FILE, model)
        self.store.write_part(point, rank_file(self.rank), part)
        self.last_save_s = time.perf_counter() - started

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


def restore_rank_part(checkpoint: Checkpoint, rank: int, stepper: Stepper) -> dict[str, Any]:
    """Restore the stepper (optimizer, scheduler, RNG, counters); return the worker's own state."""
    part = checkpoint.load(rank_file(rank))
    restore_stepper(stepper, part["stepper"])
    return part["worker"]
