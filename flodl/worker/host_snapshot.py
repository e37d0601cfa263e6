"""A rank's state copied into host memory at a checkpoint boundary, so the optimizer can go on writing into
its own while the copy is written to disk.

The copy's buffers are carved out of one host allocation (`HostRegion`), kept from one save to the next while
the state's tensors keep their shapes: allocating (and pinning) them again at every save would cost more than
the copy. The region is pinned when a tensor comes from a GPU (the copies are queued on the device's stream,
so the training thread does not wait for them) and, for a writer process, in shared memory (pinned by
registering it with CUDA). Each buffer is a storage of its own inside the region: torch.save writes exactly
its bytes, and the writer process carves the same buffers out of its own mapping of the region (`Slot`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

_ALIGN = 64  # bytes: every buffer starts on a cache line


@dataclass(frozen=True)
class Slot:
    """Where a buffer lies in its region: what a writer process needs to carve the same tensor."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def carve(region: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor at `slot` of `region` (uint8), sharing its memory."""
    storage = region.untyped_storage()[slot.offset : slot.offset + slot.nbytes]
    return torch.empty(0, dtype=slot.dtype).set_(storage).view(slot.shape)


def fill(skeleton: Any, tensor_at: Callable[[Slot], torch.Tensor]) -> Any:
    """`skeleton` (a snapshot's structure, `Slot`s in place of its tensors) with each slot's tensor."""
    return tree_map_only(Slot, tensor_at, skeleton)


class SharedRegionFailed(RuntimeError):
    """A region in shared memory could not be made: no room (a container's /dev/shm is often 64 MB), or it
    could not be pinned."""


class HostRegion:
    """One host allocation a snapshot's buffers are carved from."""

    def __init__(self, nbytes: int, pinned: bool, shared: bool) -> None:
        self._registered = False
        if not shared:
            self.bytes = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            return
        size = f"{nbytes / 2**20:,.0f} MiB"
        try:
            self.bytes = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        except RuntimeError as err:
            raise SharedRegionFailed(f"no room for a copy of {size} in shared memory ({err})") from err
        if pinned and nbytes:
            # Shared memory cannot be allocated pinned: it is pinned in place (a pageable destination would
            # make every device copy wait for the host).
            try:
                cudart = torch.cuda.cudart()
                error = cudart.cudaHostRegister(self.bytes.data_ptr(), nbytes, 0)
                pinned_in_place = error == cudart.cudaError.success
            except (AttributeError, RuntimeError) as err:  # a build without CUDA's runtime calls
                error, pinned_in_place = err, False
            if not pinned_in_place:
                raise SharedRegionFailed(f"{size} of shared memory could not be pinned ({error})")
            self._registered = True

    def release(self) -> None:
        """Unpin it (before its memory is let go)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self._registered = False


@dataclass(frozen=True)
class Taken:
    """A state copied at a boundary."""

    # The state with every tensor replaced by its copy in the region.
    value: Any
    # The same structure with `Slot`s in place of the tensors (what a writer process is sent).
    skeleton: Any
    region: HostRegion
    # The events the device's copies finish at: wait for them before reading the copy.
    ready: list[torch.cuda.Event]


class HostSnapshot:
    """Copies of a state in host buffers kept from one save to the next. The copy of the last `take` is
    overwritten by the next."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self._region: HostRegion | None = None
        self._layout: tuple[tuple[Slot, bool], ...] = ()
        self._buffers: dict[Slot, torch.Tensor] = {}

    def take(self, obj: Any) -> Taken:
        """`obj` with every tensor copied into this snapshot's buffers (a device's copies queued on its
        current stream, after the step that wrote the tensor and before the next)."""
        sources: list[torch.Tensor] = []
        slots: list[Slot] = []
        offset = 0

        def plan(tensor: torch.Tensor) -> Slot:
            nonlocal offset
            source = tensor.detach()
            slot = Slot(offset, source.dtype, tuple(source.shape))
            offset += -(-slot.nbytes // _ALIGN) * _ALIGN
            sources.append(source)
            slots.append(slot)
            return slot

        skeleton = tree_map_only(torch.Tensor, plan, obj)
        devices = {source.device for source in sources if source.is_cuda}
        layout = tuple((slot, source.is_cuda) for slot, source in zip(slots, sources, strict=True))
        if self._region is None or layout != self._layout:
            if self._region is not None:
                self._region.release()
            self._region = HostRegion(offset, pinned=bool(devices), shared=self.shared)
            self._layout = layout
            self._buffers = {slot: carve(self._region.bytes, slot) for slot in slots}
        for source, slot in zip(sources, slots, strict=True):
            self._buffers[slot].copy_(source, non_blocking=source.is_cuda)
        ready = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            ready.append(event)
        return Taken(fill(skeleton, self._buffers.__getitem__), skeleton, self._region, ready)

    def release(self) -> None:
        if self._region is not None:
            self._region.release()
            self._region = None
            self._layout = ()
            self._buffers = {}
