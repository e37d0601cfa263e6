"""A BatchDataSet over a folder of `.npy` files, memory-mapped: for data larger than RAM.

Each file is one field (sorted by file name), all with the same first dimension. Nothing is loaded up
front: a batch reads its rows through the page cache. `read_mb_s` throttles reads to a fixed rate shared by
all reading threads, to stand in for a slow source (network storage) in benchmarks.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


class NpyFolderDataSet:
    # Not in process memory: the staging tiers are worth their copy.
    resident = False

    def __init__(self, folder: str | Path, read_mb_s: float | None = None) -> None:
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.npy"))
        if not files:
            raise FileNotFoundError(f"no .npy files in {self.folder}")
        self.fields = [np.load(f, mmap_mode="r") for f in files]
        lengths = {len(a) for a in self.fields}
        if len(lengths) != 1:
            raise ValueError(f"{self.folder}: the .npy files disagree on length: {sorted(lengths)}")
        self.read_mb_s = read_mb_s
        # The throttle is one link shared by every reading thread: when it is next free.
        self._link_free_at = 0.0
        self._link = threading.Lock()

    def __len__(self) -> int:
        return len(self.fields[0])

    def get_batch(self, indices: Tensor) -> list[Tensor]:
        started = time.perf_counter()
        index = indices.numpy()
        # Read in file order (fewer seeks), hand back in the caller's order.
        order = np.argsort(index, kind="stable")
        rows = []
        for field in self.fields:
            sorted_rows = np.asarray(field[index[order]])  # fancy indexing copies out of the map
            out = np.empty_like(sorted_rows)
            out[order] = sorted_rows
            rows.append(torch.from_numpy(out))
        if self.read_mb_s:
            nbytes = sum(r.numel() * r.element_size() for r in rows)
            with self._link:
                self._link_free_at = max(self._link_free_at, started) + nbytes / (self.read_mb_s * 1e6)
                done = self._link_free_at
            time.sleep(max(done - time.perf_counter(), 0.0))
        return rows


def write_npy_folder(folder: str | Path, fields: dict[str, np.ndarray]) -> Path:
    """Write one `<name>.npy` per field; each file appears atomically, so ranks writing the same content
    at once never read a half-written file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in fields.items():
        temp = folder / f".{name}.{os.getpid()}.tmp.npy"
        np.save(temp, array)
        os.replace(temp, folder / f"{name}.npy")
    return folder
