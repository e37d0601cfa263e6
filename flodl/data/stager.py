"""The stager: a background thread that stages what this rank reads next into RAM, then disk.

What comes next is known: the read plan lists the advised batches of the shared epoch permutation. Each
pass walks the not-yet-staged samples in order of next use; a sample goes to RAM while there is room, else
it displaces the RAM resident whose next use is farthest (Belady) if that one is needed later than it, else
it goes to the disk pack while that has room (a displaced resident read again later moves to disk too, while
there is room); the walk stops when neither tier can take it (everything further is needed even later). The
decision (`plan_staging`) is pure; the thread only executes it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from flodl.data.advice import ReadPlan
from flodl.data.pack import RECORD_OVERHEAD
from flodl.data.tiers import TieredSource

log = logging.getLogger(__name__)

# Samples fetched from the source per bulk read.
FETCH_GROUP = 64
# Replan after this many taken batches even without new advice (consumed samples become evictable).
REPLAN_EVERY = 8
_IDLE_S = 0.5


@dataclass
class StagePlan:
    to_ram: list[int] = field(default_factory=list)
    to_disk: list[int] = field(default_factory=list)
    # RAM residents to evict, farthest next use first (one per sample in to_ram beyond the free slots).
    evict: list[int] = field(default_factory=list)
    # The evicted residents that are read again later: worth moving to disk rather than dropping.
    demote: list[int] = field(default_factory=list)
    # Whether every upcoming sample has a place: then only new advice can give the stager work.
    complete: bool = True


def plan_staging(
    upcoming: np.ndarray, in_ram: np.ndarray, on_disk: np.ndarray, ram_free: int, disk_free: int
) -> StagePlan:
    """Where to stage the upcoming samples (`upcoming`: the reading order, repeats allowed), given the RAM
    residents, the samples on disk and the free slots (in samples) of each tier."""
    plan = StagePlan()
    if len(upcoming) == 0:
        return plan
    unique, first = np.unique(upcoming, return_index=True)
    order = np.argsort(first, kind="stable")
    by_use, next_use = unique[order], first[order]
    staged = np.isin(by_use, np.concatenate([in_ram, on_disk]))
    candidates, candidate_use = by_use[~staged].tolist(), next_use[~staged].tolist()
    # Residents' next use (never again: infinity), farthest first.
    at = np.clip(np.searchsorted(unique, in_ram), 0, len(unique) - 1)
    resident_use = np.where(unique[at] == in_ram, first[at], np.inf) if len(in_ram) else np.empty(0)
    farthest = np.argsort(-resident_use, kind="stable")
    victims, victim_use = in_ram[farthest].tolist(), resident_use[farthest].tolist()
    v = 0
    for sample, use in zip(candidates, candidate_use, strict=True):
        if ram_free > 0:
            ram_free -= 1
            plan.to_ram.append(sample)
        elif v < len(victims) and victim_use[v] > use:
            plan.evict.append(victims[v])
            if victim_use[v] != np.inf:
                plan.demote.append(victims[v])
            v += 1
            plan.to_ram.append(sample)
        elif disk_free > 0:
            disk_free -= 1
            plan.to_disk.append(sample)
        else:
            plan.complete = False
            break
    return plan


class Stager:
    """Runs `plan_staging` against the live tiers whenever the plan moves, on a daemon thread."""

    def __init__(self, tiers: TieredSource, plan: ReadPlan) -> None:
        self.tiers = tiers
        self.plan = plan
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flodl-stager", daemon=True)
        # The plan's advice count and position at the last pass.
        self._advised = -1
        self._position = -REPLAN_EVERY
        # The last pass placed every upcoming sample: progress alone gives no new work.
        self._complete = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self.plan.changed:
            self.plan.changed.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._due():
                    self.stage_pass()
                else:
                    with self.plan.changed:
                        self.plan.changed.wait(_IDLE_S)
        except Exception:  # staging is an optimisation: the read-through still serves every batch
            log.exception("stager stopped; batches are read through the tiers without staging")

    def _due(self) -> bool:
        """New advice always replans; progress alone only every few batches."""
        plan = self.plan
        progressed = not self._complete and plan.position() - self._position >= REPLAN_EVERY
        moved = plan.advised != self._advised or progressed
        return moved and plan.pending() > 0

    def stage_pass(self) -> None:
        """One walk over the plan; returns early when the plan changes or the stager is stopped."""
        self._advised, self._position = self.plan.advised, self.plan.position()
        self._complete = False
        tiers = self.tiers
        upcoming = self.plan.upcoming_samples()
        if tiers.sample_bytes == 0 and len(upcoming):  # price a sample before planning room
            self._fetch([int(upcoming[0])], to_disk=False)
        size = max(tiers.sample_bytes, 1)
        ram, pack = tiers.ram, tiers.pack
        in_ram = np.asarray(ram.samples() if ram is not None else [], dtype=np.int64)
        on_disk = np.asarray(pack.samples() if pack is not None else [], dtype=np.int64)
        ram_free = max(ram.room(), 0) // size if ram is not None else 0
        # A record carries a header and alignment besides the sample's bytes.
        disk_free = pack.room() // (size + RECORD_OVERHEAD) if pack is not None else 0
        plan = plan_staging(upcoming, in_ram, on_disk, ram_free, disk_free)
        demote = set(plan.demote)
        for sample in plan.evict:
            rows = ram.evict(sample) if ram is not None else None
            if rows is not None:
                tiers.stats.add("stage_evictions", 1)
                if sample in demote and pack is not None:
                    pack.put(sample, rows)
        for targets, to_disk in ((plan.to_ram, False), (plan.to_disk, True)):
            for start in range(0, len(targets), FETCH_GROUP):
                if self._stop.is_set() or self.plan.advised != self._advised:
                    return
                group = [s for s in targets[start : start + FETCH_GROUP] if not tiers.staged(s)]
                if group:
                    self._fetch(group, to_disk)
        self._complete = plan.complete

    def _fetch(self, samples: list[int], to_disk: bool) -> None:
        tiers = self.tiers
        mine = tiers.claim(samples)  # the training thread may be reading some of them right now
        try:
            if mine:
                fetched = tiers.source.get_batch(torch.as_tensor(mine, dtype=torch.int64))
                tiers.stats.add("stage_reads", len(mine))
                tiers.admit_batch(mine, fetched, to_disk)
        finally:
            tiers.release(mine)
