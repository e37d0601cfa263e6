"""SampleFeeder: the data plane of a map-style Dataset, whose samples may be of any structure.

    Dataset[i] (in `num_workers` DataLoader workers, or the prefetch thread) ─▶ collate_fn ─▶ transform
        ─▶ prefetch queue ─▶ moved to the device in `load` ─▶ step

torch's DataLoader builds the batches; its batch sampler walks the read plan (`PlanSampler`), so a rank reads
the picks it was handed, in their order, whatever `num_workers` is. A dataset read afresh (the default) runs
`__getitem__` for every pick of every epoch, each batch under its own random streams (flodl/data/streams.py):
augmentation inside it draws anew for every batch, differently on every rank, the same in every run. With
`num_workers=0` a batch is read in the step's thread when it is due, as torch's DataLoader does (the step's
own draws and the reads' must not interleave); with workers, ahead. A dataset declared cacheable
(`task.cacheable=true`) is read through the RAM tier and the disk pack (`CachedSamples`): each sample from
its source once, `task.transform` on every read.
"""

from __future__ import annotations

import multiprocessing.util
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from flodl.config.host import available_ram
from flodl.data.advice import PlannedBatch, ReadPlan, batch_key
from flodl.data.augment import view_keys
from flodl.data.feeder import DataPlaneSettings, PickedFeeder, staging_budgets
from flodl.data.pack import PackFile
from flodl.data.partition import picks_to_samples
from flodl.data.prefetch import CPU_DEPTH, Prefetcher
from flodl.data.ram_cache import RamCache
from flodl.data.sample import check_movable, nbytes, owned, to_device
from flodl.data.streams import SeededIndices, SeededReads, batch_seed
from flodl.data.tiers import FeedStats

Collate = Callable[[list[Any]], Any]


class PlanSampler:
    """A DataLoader batch sampler over the read plan: each planned batch's sample indices (`indices` makes
    them), from `start` up to the last batch advised so far (a later advice is read by a new iteration from
    where this one ended)."""

    def __init__(self, plan: ReadPlan, indices: Callable[[PlannedBatch], list[int]]) -> None:
        self.plan = plan
        self.indices = indices
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        position = self.start
        while (planned := self.plan.get(position)) is not None:
            yield self.indices(planned)
            position += 1


class CachedSamples(Dataset):
    """A dataset declared deterministic, read through the RAM tier then the disk pack: each sample is read
    from its source once and admitted (RAM while under budget, else disk)."""

    def __init__(self, source: Any, ram: RamCache | None, pack: PackFile | None, stats: FeedStats) -> None:
        self.source = source
        self.ram = ram
        self.pack = pack
        self.stats = stats

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        value = self.ram.get(index) if self.ram is not None else None
        if value is not None:
            self.stats.add("hits_ram", 1)
            return value
        value = self.pack.get(index) if self.pack is not None else None
        if value is not None:
            self.stats.add("hits_disk", 1)
            self.stats.add("bytes_disk", nbytes(value))
            return value
        value = self.source[index]
        self.stats.add("source_reads", 1)
        ram = self.ram
        held = ram is not None and nbytes(value) <= ram.room() and ram.put(index, owned(value))
        if not held and self.pack is not None:
            try:
                self.pack.put(index, value)
            except TypeError as err:
                raise TypeError(
                    f"task.train_data (task.cacheable=true) sample {index}: {err}; return those from "
                    "__getitem__, or set disk_stage_gb=0 (the RAM tier holds any value)"
                ) from None
        return value


class SampleFeeder(PickedFeeder):
    """A map-style Dataset's feeder (flodl/data/feeders.py)."""

    def __init__(
        self,
        settings: DataPlaneSettings,
        dataset: Any,
        device: torch.device,
        collate: Collate,
        tiers: tuple[RamCache | None, PackFile | None] | None = None,
        transform: Callable[[Any, list], Any] | None = None,
    ) -> None:
        """`tiers`: the RAM tier and disk pack of a dataset declared cacheable (None: read afresh)."""
        self.settings = settings
        self.device = device
        self.transform = transform
        self.collate = collate
        self.plan = ReadPlan(settings.augment)
        self.stats = FeedStats()
        self.cached = CachedSamples(dataset, *tiers, self.stats) if tiers is not None else None
        self.source = self.cached if self.cached is not None else SeededReads(dataset)
        self.sampler = PlanSampler(self.plan, lambda planned: self._indices(planned.picks, planned.epoch))
        workers = settings.num_workers
        self.loader = DataLoader(
            self.source,
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=settings.pin_memory and device.type == "cuda",
            prefetch_factor=settings.prefetch_factor if workers > 0 else None,
            persistent_workers=settings.persistent_workers and workers > 0,
        )
        self._iterator: Iterator[Any] | None = None
        self._next_position = -1
        self._checked = False
        # debug.data_plane=false: every batch read in the step's thread, as a plain loop would; so are the
        # batches of a dataset read afresh without workers (a read there draws from the process's generators).
        reads_ahead = workers > 0 or self.cached is not None
        depth = CPU_DEPTH if settings.data_plane and reads_ahead else 0
        self.prefetcher = Prefetcher(self.plan, self._planned_batch, depth, self._setup)
        multiprocessing.util.Finalize(self, self.prefetcher.stop, exitpriority=20)

    def advise(self, epoch: int, picks: Tensor) -> None:
        """The worker will train these picks of `epoch` (after what it was advised before)."""
        self.plan.add(epoch, picks, self.settings.batch_size)
        ram = self.cached.ram if self.cached is not None else None
        if ram is not None:
            ram.budget = staging_budgets(self.settings, available_ram(), ram.bytes).ram or 0

    def load(self, picks: Tensor, epoch: int) -> Any:
        """The batch of exactly `picks` of `epoch` (its transform's key), as `collate_fn` built it, on the
        device."""
        started = time.perf_counter()
        position = self.plan.find(batch_key(picks))
        batch = None
        if position is not None:
            # Only the prefetch thread reads the DataLoader, in plan order: skip to this batch and wait for it
            # (a read here would run in the rank's process and throw away the loader's read-ahead).
            self.plan.take(position - 1)
            batch = self.prefetcher.take(position, wait=True)
        if batch is None:
            indices = self._indices(picks, epoch)
            self._count_fresh(len(indices))
            batch = self._transformed(self.collate(self._read(indices)), picks, epoch)
        if not self._checked:  # once: a value the device move would leave behind fails here, named
            check_movable(batch, "task.train_data")
            self._checked = True
        batch = to_device(batch, self.device, non_blocking=True)
        self.stats.record_load(started)
        if position is not None:
            self.plan.take(position)
        return batch

    def close(self) -> None:
        self.prefetcher.stop()
        self._iterator = None
        if self.cached is not None and self.cached.pack is not None:
            self.cached.pack.close()

    def _setup(self) -> None:
        # The DataLoader pins on the current device of the thread that iterates it (and of its pin thread).
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _indices(self, picks: Tensor, epoch: int) -> list[int]:
        """The batch's sample indices; read afresh, with the stream its reads draw from."""
        samples = picks_to_samples(picks, self.settings.augment).tolist()
        if self.cached is not None:
            return samples
        return SeededIndices(samples, batch_seed(self.settings.seed, epoch, int(picks[0])))

    def _read(self, indices: list[int]) -> list[Any]:
        if isinstance(self.source, SeededReads):
            assert isinstance(indices, SeededIndices)
            return self.source.__getitems__(indices)
        return [self.source[i] for i in indices]

    def _count_fresh(self, samples: int) -> None:
        if self.cached is None:  # a cached read counts itself, by tier
            self.stats.add("source_reads", samples)

    def _planned_batch(self, planned: PlannedBatch) -> Any:
        """The planned batch from the DataLoader; a new iteration starts there when the last one ended (at the
        end of the plan as it was then) or the worker skipped ahead of it."""
        if self._iterator is None or planned.position != self._next_position:
            self._iterator = self._iterate_from(planned.position)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = self._iterate_from(planned.position)
            batch = next(self._iterator)
        self._next_position = planned.position + 1
        self._count_fresh(len(planned.samples))
        return self._transformed(batch, planned.picks, planned.epoch)

    def _iterate_from(self, position: int) -> Iterator[Any]:
        self.sampler.start = position
        return iter(self.loader)

    def _transformed(self, batch: Any, picks: Tensor, epoch: int) -> Any:
        if self.transform is None:
            return batch
        return self.transform(batch, view_keys(picks, self.settings.augment, epoch, self.settings.seed))
