"""The RAM tier: raw samples keyed by sample index, under a byte budget.

A sample is a BatchDataSet's fields' rows (one tensor per field, without the batch dimension) or a map-style
Dataset's item as `__getitem__` gave it; its tensors are owned by the cache.
Admission never evicts: the stager decides what leaves (farthest next use first). Thread-safe: the
training thread reads and admits while the stager stages and evicts.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor

from flodl.data.sample import nbytes

Rows = list[Tensor]


class RamCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self._rows: dict[int, Any] = {}
        self._lock = threading.Lock()

    def __contains__(self, sample: int) -> bool:
        return sample in self._rows

    def get(self, sample: int) -> Any | None:
        return self._rows.get(sample)

    def room(self) -> int:
        return self.budget - self.bytes

    def put(self, sample: int, rows: Any) -> bool:
        """Admit `rows` (already owned copies) if they fit the budget; True when the sample is held."""
        size = nbytes(rows)
        with self._lock:
            if sample in self._rows:
                return True
            if self.bytes + size > self.budget:
                return False
            self._rows[sample] = rows
            self.bytes += size
            return True

    def evict(self, sample: int) -> Any | None:
        with self._lock:
            rows = self._rows.pop(sample, None)
            if rows is not None:
                self.bytes -= nbytes(rows)
            return rows

    def samples(self) -> list[int]:
        with self._lock:
            return list(self._rows)
