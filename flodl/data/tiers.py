"""The read-through over the staging tiers: RAM, then the disk pack, then the source.

`fetch(samples)` serves each row from the first tier that holds it, reads every miss from the source in one
bulk call, admits each fetched row (RAM while under budget, else disk) and stitches the rows back in the
caller's order. `FeedStats` counts what each tier served, for the per-chunk data metrics.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import Tensor

from flodl.data.dataset import BatchDataSet
from flodl.data.pack import PackFile
from flodl.data.ram_cache import RamCache, Rows
from flodl.data.sample import nbytes
from flodl.metrics.scalars import record_scalar

log = logging.getLogger(__name__)

# Longest wait for another thread's read of a sample before reading it again.
_INFLIGHT_WAIT_S = 30.0

STAT_NAMES = (
    "hits_vram",
    "hits_ram",
    "hits_disk",
    "source_reads",
    "bytes_disk",
    "stage_reads",
    "stage_evictions",
    "starve_ms",
)


class FeedStats:
    """Counters added from the training, prefetch and stager threads; drained by the training thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_NAMES, 0.0)
        self.totals = dict.fromkeys(STAT_NAMES, 0.0)

    def add(self, name: str, value: float) -> None:
        with self._lock:
            self._counts[name] += value
            self.totals[name] += value

    def drain(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(STAT_NAMES, 0.0)
        return counts

    def record_load(self, started: float) -> None:
        """A load that began at `started` (perf_counter) is done: its wait counts as starve time, and every
        counter since the last load goes out as a `data/*` scalar."""
        self.add("starve_ms", (time.perf_counter() - started) * 1000)
        for name, value in self.drain().items():
            record_scalar(f"data/{name}", value)


class TieredSource:
    def __init__(
        self, source: BatchDataSet, ram: RamCache | None, pack: PackFile | None, stats: FeedStats
    ) -> None:
        self.source = source
        self.ram = ram
        self.pack = pack
        self.stats = stats
        # The largest sample seen: prices the stager's room checks.
        self.sample_bytes = 0
        self._warned_small_ram = False
        # Samples being read from the source by some thread, and the event set when they are admitted.
        self._inflight: dict[int, threading.Event] = {}
        self._inflight_lock = threading.Lock()

    def fetch(self, samples: Tensor) -> list[Tensor]:
        ids = samples.tolist()
        ram_pos: list[int] = []
        ram_rows: list[Rows] = []
        disk_pos: list[int] = []
        for i, sample in enumerate(ids):
            got = self.ram.get(sample) if self.ram is not None else None
            if got is not None:
                ram_pos.append(i)
                ram_rows.append(got)
            else:
                disk_pos.append(i)
        parts: list[tuple[list[int], list[Tensor]]] = []
        if ram_rows:
            self.stats.add("hits_ram", len(ram_rows))
            parts.append((ram_pos, _stitch(ram_rows)))
        miss_pos = self._from_disk(ids, disk_pos, parts) if self.pack is not None else disk_pos
        if miss_pos:
            parts.append((miss_pos, self._read_misses([ids[i] for i in miss_pos])))
        if len(parts) == 1:  # one tier served all, in order
            return parts[0][1]
        first = parts[0][1]
        out = [torch.empty((len(ids), *f.shape[1:]), dtype=f.dtype) for f in first]
        for positions, fields in parts:
            index = torch.as_tensor(positions)
            for target, field in zip(out, fields, strict=True):
                target.index_copy_(0, index, field)
        return out

    def _read_misses(self, misses: list[int]) -> list[Tensor]:
        """The rows of samples no tier holds, in order. A sample the stager is reading right now is waited
        for rather than read twice (the source is the scarce resource); the rest is read in one call."""
        mine = self.claim(misses)
        try:
            fetched = self.read_source(torch.as_tensor(mine)) if mine else []
        finally:
            self.release(mine)
        if len(mine) == len(misses):  # nothing in flight elsewhere, no repeats: already in order
            return fetched
        rows: dict[int, Rows] = {s: [f[j] for f in fetched] for j, s in enumerate(mine)}
        for sample in misses:
            if sample not in rows:
                event = self._inflight.get(sample)
                if event is not None:
                    event.wait(_INFLIGHT_WAIT_S)
                got = self._held(sample)
                rows[sample] = (
                    got if got is not None else [f[0] for f in self.read_source(torch.tensor([sample]))]
                )
        return _stitch([rows[s] for s in misses])

    def _held(self, sample: int) -> Rows | None:
        got = self.ram.get(sample) if self.ram is not None else None
        if got is None and self.pack is not None:
            got = self.pack.get(sample)
        return got

    def claim(self, samples: list[int]) -> list[int]:
        """Mark the samples this thread will read from the source; returns those no other thread is
        reading (each once)."""
        mine = []
        with self._inflight_lock:
            for sample in samples:
                if sample not in self._inflight:
                    self._inflight[sample] = threading.Event()
                    mine.append(sample)
        return mine

    def release(self, samples: list[int]) -> None:
        with self._inflight_lock:
            for sample in samples:
                self._inflight.pop(sample).set()

    def _from_disk(self, ids: list[int], positions: list[int], parts: list) -> list[int]:
        """Serve what the pack holds (appending to `parts`); returns the positions still missing."""
        pack = self.pack
        assert pack is not None
        held = [i for i in positions if ids[i] in pack]
        if not held:
            return positions
        missing = [i for i in positions if ids[i] not in pack]
        stacked = pack.read_batch([ids[i] for i in held])
        if stacked is None:  # records of different layouts: one by one
            rows = [pack.get(ids[i]) for i in held]
            good = [i for i, r in zip(held, rows, strict=True) if r is not None]
            missing += [i for i, r in zip(held, rows, strict=True) if r is None]
            fields = _stitch([r for r in rows if r is not None]) if good else []
        else:
            fields, bad = stacked
            good = [i for j, i in enumerate(held) if j not in set(bad)]
            missing += [held[j] for j in bad]
        if good:
            self.stats.add("hits_disk", len(good))
            self.stats.add("bytes_disk", sum(f.numel() * f.element_size() for f in fields))
            parts.append((good, fields))
        return sorted(missing)

    def read_source(self, samples: Tensor) -> list[Tensor]:
        """One bulk read from the source; every row is admitted to a tier."""
        fetched = self.source.get_batch(samples)
        self.stats.add("source_reads", len(samples))
        self.admit_batch(samples.tolist(), fetched)
        return fetched

    def admit_batch(self, samples: list[int], fields: list[Tensor], to_disk: bool = False) -> None:
        if self.ram is None and self.pack is None:
            return
        for j, sample in enumerate(samples):
            self.admit(sample, [field[j] for field in fields], to_disk)

    def admit(self, sample: int, rows: Rows, to_disk: bool = False) -> bool:
        """Hold the sample in RAM while under budget (as owned copies), else on disk (the pack copies)."""
        size = nbytes(rows)
        self.sample_bytes = max(self.sample_bytes, size)
        ram = self.ram
        if ram is not None and not to_disk:
            if size <= ram.room() and ram.put(sample, [t.clone() for t in rows]):
                return True
            if 0 < ram.budget < size and not self._warned_small_ram:
                self._warned_small_ram = True
                log.warning(
                    "RAM stage budget (%d bytes) is smaller than one sample (%d bytes): the RAM tier holds "
                    "nothing; raise ram_max_usage or rely on the disk tier",
                    ram.budget,
                    size,
                )
        return self.pack is not None and self.pack.put(sample, rows)

    def staged(self, sample: int) -> bool:
        return (self.ram is not None and sample in self.ram) or (
            self.pack is not None and sample in self.pack
        )


def _stitch(rows: list[Rows]) -> list[Tensor]:
    return [torch.stack([r[k] for r in rows]) for k in range(len(rows[0]))]
