"""The device sample pool: raw samples kept resident on the GPU while the VRAM budget allows.

One slab per field holds `capacity` rows. A batch's hits are gathered on the device; only its misses are
uploaded, and each uploaded row is copied into a free slot (device to device) until the pool is full: no
eviction, no extra host transfer. The pool holds raw rows: the transform runs after assembly.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class DevicePool:
    def __init__(self, device: torch.device, capacity: int, template: list[Tensor]) -> None:
        """`template`: one sample's rows (fields without the batch dimension) giving shapes and dtypes."""
        self.device = device
        self.capacity = capacity
        self.slabs = [torch.empty((capacity, *t.shape), dtype=t.dtype, device=device) for t in template]
        self._slot_of: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slabs)

    def lookup(self, samples: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(positions that hit, their slots, positions that miss) of a batch's samples."""
        hits, slots, misses = [], [], []
        with self._lock:
            slot_of = self._slot_of
            for i, sample in enumerate(samples):
                slot = slot_of.get(sample)
                if slot is None:
                    misses.append(i)
                else:
                    hits.append(i)
                    slots.append(slot)
        return hits, slots, misses

    def gather(self, slots: Tensor) -> list[Tensor]:
        """Rows at `slots` (a device index tensor), on the current stream."""
        return [slab.index_select(0, slots) for slab in self.slabs]

    def admit(self, samples: list[int], rows: list[Tensor]) -> None:
        """Copy the rows of samples not held yet into free slots (on the current stream), while room lasts.

        Slots are published and their copies enqueued under one lock, so a lookup that sees a slot comes
        after its copy on the stream (every user of the pool assembles on the same side stream)."""
        with self._lock:
            free = self.capacity - len(self._slot_of)
            picked: dict[int, int] = {}  # sample -> its row in `rows`
            for j, sample in enumerate(samples):
                if len(picked) >= free:
                    break
                if sample not in self._slot_of and sample not in picked:
                    picked[sample] = j
            if not picked:
                return
            first = len(self._slot_of)
            src = torch.as_tensor(list(picked.values()), dtype=torch.int64).to(self.device, non_blocking=True)
            for slab, field in zip(self.slabs, rows, strict=True):
                slab[first : first + len(picked)] = field.index_select(0, src)
            for k, sample in enumerate(picked):
                self._slot_of[sample] = first + k
