"""BatchFeeder: the data plane behind `Stepper.load` — the one place a worker gets its batches.

    source ─▶ RAM tier ─▶ disk pack ─▶ (device pool) ─▶ transform ─▶ prefetch queue ─▶ step
                  ▲ stager thread (follows the read plan)        ▲ prefetch thread (follows the read plan)

`advise(epoch, picks)` adds a slice the worker was handed to the read plan; `load(picks, epoch)` returns
the batch of exactly those picks: from the prefetch queue when it is the plan's next batch, else assembled
on the spot. Correctness never depends on the advice. On CUDA batches are pinned, uploaded on a side stream
and ordered before the step with an event; the first chunk runs without prefetch to measure the activation
peak, later advice re-sizes the depth from the VRAM budget. Switches for A/B runs: `debug.stager=false` (no
RAM or disk tier, no stager), `vram_pool=false` (no device pool), `debug.data_plane=false` (none of it).
"""

from __future__ import annotations

import logging
import multiprocessing.util
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flodl.config.host import available_ram
from flodl.data.advice import PlannedBatch, ReadPlan, batch_key
from flodl.data.augment import Transform, apply_transform
from flodl.data.dataset import BatchDataSet
from flodl.data.device_pool import DevicePool
from flodl.data.memory import pool_budget, prefetch_depth, ram_budget
from flodl.data.pack import PackFile
from flodl.data.partition import picks_to_samples
from flodl.data.prefetch import CPU_DEPTH, Prefetcher
from flodl.data.ram_cache import RamCache
from flodl.data.stager import Stager
from flodl.data.tiers import FeedStats, TieredSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlaneSettings:
    """What the data plane reads of the run's config (mapped once, by flodl/job/assembly.py)."""

    batch_size: int
    augment: int
    seed: int
    ram_max_usage: float
    vram_max_usage: float
    sample_cache: bool
    vram_pool: bool
    # The disk tier's bytes per rank (0: off) and the folder its pack file goes in.
    disk_stage_bytes: int
    stage_dir: str
    # debug.stager: the RAM and disk tiers and the stager thread.
    stager: bool
    # debug.data_plane: false reads and copies each batch in the step's thread, as a plain loop would (the A/B
    # baseline for the whole plane).
    data_plane: bool
    # Ranks on this host: they share its RAM.
    ranks_on_host: int
    # torch DataLoader knobs for a map-style Dataset read afresh (flodl/data/sample_feed.py).
    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = True
    pin_memory: bool = True
    # This rank and the world's ranks: a stream's readers are numbered from them (flodl/data/stream.py).
    rank: int = 0
    world_size: int = 1
    # task.stream_split: which levels a stream splits among its readers itself (flodl/data/stream_split.py).
    stream_split: str = "auto"


@dataclass(frozen=True)
class StagingBudgets:
    """The staging tiers a rank gets for data not already in memory, in bytes (None: the tier is off)."""

    ram: int | None
    disk: int | None


def staging_budgets(settings: DataPlaneSettings, available: int, held: int = 0) -> StagingBudgets:
    """The run's staging tiers given `available` RAM (and `held`, what the RAM tier holds already); what
    `plan=true` prints for the same host facts."""
    if not (settings.data_plane and settings.stager):
        return StagingBudgets(None, None)
    ram = None
    if settings.sample_cache and settings.ram_max_usage > 0:
        ram = ram_budget(available, held, settings.ram_max_usage, settings.ranks_on_host)
    return StagingBudgets(ram, settings.disk_stage_bytes or None)


def staging_tiers(settings: DataPlaneSettings) -> tuple[RamCache | None, PackFile | None] | None:
    """The RAM tier and disk pack the settings ask for (None: neither)."""
    if not settings.stager:
        log.info("stager off (debug.stager=false): batches are read from the source")
        return None
    budgets = staging_budgets(settings, available_ram())
    ram = RamCache(budgets.ram) if budgets.ram is not None else None
    pack = PackFile(settings.stage_dir, budgets.disk) if budgets.disk is not None else None
    if ram is None and pack is None:
        return None
    log.info(
        "staging tiers: RAM %s, disk %s",
        f"{ram.budget / 2**20:.3g} MiB" if ram is not None else "off",
        f"{pack.budget / 2**20:.3g} MiB in {pack.path}" if pack is not None and pack.enabled else "off",
    )
    return ram, pack


class PickedFeeder:
    """What the map-style feeders (BatchFeeder, SampleFeeder) share: a pick names a sample's view, so the
    picks say all a resumed rank needs and a rank's checkpoint keeps nothing of where the reads stand."""

    in_order = False

    def state(self) -> None:
        """Nothing: the picks name every batch a resumed rank reads."""
        return None

    def restore(self, state: dict[str, Any]) -> None:
        """`state` holds a stream's reader positions: the checkpoint is of other data."""
        raise ValueError(
            "the checkpoint was written by a run whose task.train_data was a stream (an IterableDataset), "
            "this run's is not: resume it with the same data, or start fresh with resume=never"
        )


class BatchFeeder(PickedFeeder):
    """A BatchDataSet's feeder (flodl/data/feeders.py)."""

    def __init__(
        self,
        settings: DataPlaneSettings,
        dataset: BatchDataSet,
        device: torch.device,
        transform: Transform | None = None,
        cacheable: bool = True,
    ) -> None:
        """`cacheable`: the dataset's reads are deterministic: the tiers and the device pool may keep them."""
        self.settings = settings
        self.cacheable = cacheable
        self.dataset = dataset
        if device.type == "cuda" and device.index is None:  # the data threads must name the device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.transform = transform
        self.plan = ReadPlan(settings.augment)
        self.stats = FeedStats()
        resident = not settings.data_plane or bool(getattr(dataset, "resident", False))
        # Whether anything between the source and the step exists (then the data/* metrics are recorded).
        # Data already in process memory goes straight to the step: gathering it in the step's thread is
        # cheaper than handing it over from a pipeline (measured: docs/data.md).
        self.active = not resident
        self.cuda = device.type == "cuda" and self.active
        self.tiers = self._tiers(resident) if self.active else None
        self.stager = Stager(self.tiers, self.plan) if self.tiers is not None else None
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.activation: int | None = None
        self.batch_bytes = 0
        self._template: list[Tensor] | None = None
        self._loads = 0
        self.pool: DevicePool | None = None
        self._pool_wanted = self.cuda and cacheable and settings.vram_pool
        self.prefetcher: Prefetcher | None = None
        if self.active:
            self.prefetcher = Prefetcher(
                self.plan, self._assemble_planned, 0 if self.cuda else CPU_DEPTH, self._setup
            )
        if self.stager is not None:
            self.stager.start()
        # Stop the threads at exit before the pack file goes (also in multiprocessing-spawned ranks).
        multiprocessing.util.Finalize(self, _shutdown, args=(self.stager, self.prefetcher), exitpriority=20)

    def advise(self, epoch: int, picks: Tensor) -> None:
        """The worker will train these picks of `epoch` (after what it was advised before)."""
        if not self.active:
            return
        self.plan.add(epoch, picks, self.settings.batch_size)
        ram = self.tiers.ram if self.tiers is not None else None
        if ram is not None:
            ram.budget = staging_budgets(self.settings, available_ram(), ram.bytes).ram or 0
        if self.cuda and self._loads > 0:
            self._resize()

    def load(self, picks: Tensor, epoch: int) -> list[Tensor]:
        """The batch of exactly `picks` of `epoch` on the device (the epoch keys the transform)."""
        if not self.active:  # resident data on the CPU, or the plane switched off: nothing to overlap
            return [t.to(self.device, non_blocking=True) for t in self._assemble(picks, epoch)]
        started = time.perf_counter()
        position = self.plan.find(batch_key(picks))
        ready = None
        if position is not None:
            ready = self.prefetcher.take(position) if self.prefetcher is not None else None
        if ready is None:
            ready = self._assemble(picks, epoch)
        batch = self._finish(ready)
        self._loads += 1
        if self.cuda and self._loads == 1:  # the first chunk's peak prices the activations
            torch.cuda.reset_peak_memory_stats(self.device)
        self.stats.record_load(started)
        if position is not None:
            # Last: it wakes the data threads, which would otherwise hold the interpreter while this
            # thread still has work before the step.
            self.plan.take(position)
        return batch

    def close(self) -> None:
        _shutdown(self.stager, self.prefetcher)
        if self.tiers is not None and self.tiers.pack is not None:
            self.tiers.pack.close()

    # --- building ---

    def _tiers(self, resident: bool) -> TieredSource | None:
        if not self.cacheable:
            log.info("train data read afresh every epoch (task.cacheable=false): no RAM or disk tier")
            return None
        if resident:
            # A copy of data already in process memory would only double its footprint.
            if self.settings.disk_stage_bytes:
                log.info("train data is resident in memory: the disk tier is not used")
            return None
        tiers = staging_tiers(self.settings)
        return TieredSource(self.dataset, *tiers, self.stats) if tiers is not None else None

    def _setup(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)

    # --- sizing (CUDA) ---

    def _resize(self) -> None:
        """Measure the activation peak since the last advice; size the pool (once) and the prefetch depth."""
        dev = self.device
        allocated = torch.cuda.memory_allocated(dev)
        peak = torch.cuda.max_memory_allocated(dev) - allocated
        self.activation = max(self.activation or 0, peak)
        torch.cuda.reset_peak_memory_stats(dev)
        free, total = torch.cuda.mem_get_info(dev)
        # Blocks the caching allocator holds but nobody uses are free for the prefetch queue.
        used = total - free - (torch.cuda.memory_reserved(dev) - allocated)
        cap = self.plan.pending()
        max_usage = self.settings.vram_max_usage
        depth = prefetch_depth(total, used, max_usage, self.activation, self.batch_bytes, cap)
        if self._pool_wanted and self._template is not None:
            self._pool_wanted = False
            headroom = int(total * max_usage) - used - self.activation
            self._make_pool(pool_budget(headroom, depth, self.batch_bytes))
            if self.pool is not None:
                used += self.pool.nbytes
                depth = prefetch_depth(total, used, max_usage, self.activation, self.batch_bytes, cap)
        if self.prefetcher is not None:
            self.prefetcher.set_depth(depth)
        log.debug("prefetch depth %d (activation %d B, batch %d B)", depth, self.activation, self.batch_bytes)

    def _make_pool(self, budget: int) -> None:
        assert self._template is not None
        sample_bytes = max(sum(t.numel() * t.element_size() for t in self._template), 1)
        capacity = min(budget // sample_bytes, len(self.dataset))
        if capacity < 1:
            log.info("device sample pool dormant: no VRAM budget left after the prefetch queue")
            return
        self.pool = DevicePool(self.device, capacity, self._template)
        log.info(
            "device sample pool: %d of %d samples (%.1f MiB)",
            capacity,
            len(self.dataset),
            self.pool.nbytes / 2**20,
        )

    # --- assembly ---

    def _assemble_planned(self, planned: PlannedBatch) -> Any:
        return self._assemble(planned.picks, planned.epoch)

    def _assemble(self, picks: Tensor, epoch: int) -> Any:
        augment, seed = self.settings.augment, self.settings.seed
        samples = picks_to_samples(picks, augment)
        if not self.cuda:
            rows = self._fetch(samples)
            return apply_transform(self.transform, rows, picks, augment, epoch, seed)
        assert self.side is not None
        with torch.cuda.stream(self.side):
            raw = self._gather_or_upload(samples)
            if self._template is None:
                self._template = [torch.empty(t.shape[1:], dtype=t.dtype, device="meta") for t in raw]
                self.batch_bytes = sum(t.numel() * t.element_size() for t in raw)
            batch = apply_transform(self.transform, raw, picks, augment, epoch, seed)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return batch, ready

    def _gather_or_upload(self, samples: Tensor) -> list[Tensor]:
        """The raw batch on the device (on the side stream): pool hits gathered, misses uploaded."""
        ids = samples.tolist()
        if self.pool is None:
            return self._upload(self._fetch(samples))
        hits, slots, misses = self.pool.lookup(ids)
        if not hits:
            raw = self._upload(self._fetch(samples))
            self.pool.admit(ids, raw)
            return raw
        self.stats.add("hits_vram", len(hits))
        gathered = self.pool.gather(self._index(slots))
        raw = [torch.empty((len(ids), *g.shape[1:]), dtype=g.dtype, device=self.device) for g in gathered]
        for out, rows in zip(raw, gathered, strict=True):
            out.index_copy_(0, self._index(hits), rows)
        if misses:
            uploaded = self._upload(self._fetch(samples[misses]))
            for out, rows in zip(raw, uploaded, strict=True):
                out.index_copy_(0, self._index(misses), rows)
            self.pool.admit([ids[i] for i in misses], uploaded)
        return raw

    def _fetch(self, samples: Tensor) -> list[Tensor]:
        if self.tiers is not None:
            return self.tiers.fetch(samples)
        self.stats.add("source_reads", len(samples))
        return self.dataset.get_batch(samples)

    def _upload(self, rows: list[Tensor]) -> list[Tensor]:
        # Pinned host memory makes the copy asynchronous; the caching host allocator keeps the pinned
        # block until the side stream has read it.
        return [(t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True) for t in rows]

    def _index(self, positions: list[int]) -> Tensor:
        return torch.tensor(positions, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)

    def _finish(self, ready: Any) -> list[Tensor]:
        if not self.cuda:
            return list(ready)
        batch, event = ready
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in batch:
            t.record_stream(current)  # allocated on the side stream, used (and freed) on this one
        return batch


def _shutdown(stager: Stager | None, prefetcher: Prefetcher | None) -> None:
    if prefetcher is not None:
        prefetcher.stop()
    if stager is not None:
        stager.stop()
