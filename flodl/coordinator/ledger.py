"""Epoch bookkeeping on rank 0: which chunks and evals each epoch still waits for, and when it is done.

An epoch is complete once the ranks have reported every batch planned for it; it is emitted (turned
into EpochMetrics, in epoch order) once its eval, if one was scheduled, has arrived from every rank that
evaluated it (the members at its round).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from flodl.counting import shown_epoch
from flodl.links.messages import ChunkReport, EvalResult
from flodl.metrics.aggregate import EpochMetrics, RoundCost, aggregate_epoch


class LedgerError(RuntimeError):
    pass


MEMBERSHIP_EVENTS = ("rank_cut", "rank_admitted")


@dataclass
class _Epoch:
    chunks: list[ChunkReport] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    # None: not known yet whether this epoch gets an eval (async decides at a later reduce).
    eval_expected: bool | None = None
    # The eval results it waits for: one per member at the round that evaluated it (each its shard).
    eval_ranks: int = 0
    completed_at: float | None = None
    # Averaging rounds started while this epoch was the oldest open one, and what they cost each rank.
    rounds_open: int = 0
    rounds_closed: int = 0
    rounds: dict[int, RoundCost] = field(default_factory=dict)
    # Membership changes while this epoch was the oldest open one (see EpochLedger.membership_event).
    membership: list[dict[str, Any]] = field(default_factory=list)
    # The batches it waits for when they differ from batches_per_epoch (see EpochLedger.expect_batches).
    batches: int | None = None
    # Batches trained by a sharded group that left before reporting them (see EpochLedger.lose_batches).
    lost: int = 0


class EpochLedger:
    def __init__(
        self,
        epochs: int,
        world_size: int,
        batches_per_epoch: int,
        local_sgd: bool = False,
        first_epoch: int = 0,
        comm_bytes_total: int = 0,
        overlapping: bool = False,
    ) -> None:
        """`local_sgd`: ranks average in rounds (cadence / async). The last epoch is held back until
        `release()` (rounds run after the last batch: async drains its queues, and their bytes belong to the
        last epoch), and an epoch no round fell into had no averaging. Otherwise DDP: every optimizer step
        averages.
        `first_epoch` and `comm_bytes_total`: where a resumed run continues.
        `overlapping`: epochs overlap (async): throughput over each epoch's common window."""
        self.epochs = epochs
        self.world_size = world_size
        self.batches_per_epoch = batches_per_epoch
        self.started_at = time.perf_counter()
        self._open: dict[int, _Epoch] = {}
        self.first_epoch = first_epoch
        self.next_to_emit = first_epoch
        self.comm_bytes_total = comm_bytes_total
        # The total after each epoch emitted (a checkpoint committed later records its own epoch's).
        self._comm_bytes_after: dict[int, int] = {first_epoch - 1: comm_bytes_total}
        self._last_finish: float | None = None
        self._round_epoch: dict[int, int] = {}
        self.local_sgd = local_sgd
        self.hold_last = local_sgd
        self.overlapping = overlapping
        # The ranks training now: each record's `world` counts them as it is emitted.
        self.members = set(range(world_size))
        # The last record's `step`: the busiest rank's steps so far (the next record's starts there).
        self.step = 0

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch < self.next_to_emit or epoch >= self.epochs:
            raise LedgerError(f"a report for epoch {shown_epoch(epoch)}, outside the open epochs")
        return self._open.setdefault(epoch, _Epoch())

    def comm_bytes_after(self, epoch: int) -> int:
        """Bytes on the wire through the end of `epoch` (emitted), from the run's start."""
        return self._comm_bytes_after[epoch]

    def holds(self, epoch: int) -> bool:
        """Whether `epoch`'s record can still be read: not emitted yet, or the entry kept until the epoch
        after it is emitted."""
        return epoch >= self.next_to_emit or epoch in self._open

    def reported_batches(self, epoch: int) -> int:
        """Batches of `epoch` reported so far (a run resumed inside it: those its checkpoint held)."""
        entry = self._open.get(epoch)
        return 0 if entry is None else sum(c.batches for c in entry.chunks)

    def reported_samples(self, epoch: int) -> int:
        """Samples of `epoch` reported so far."""
        entry = self._open.get(epoch)
        return 0 if entry is None else sum(c.samples for c in entry.chunks)

    def partial(self, epoch: int, chunks: Mapping[int, int] | None = None) -> dict[str, Any]:
        """What `epoch`'s record holds so far, as plain data for a checkpoint inside it: of each rank in
        `chunks`, its first `chunks[rank]` chunks (those it reported before its part; None: every chunk
        reported so far), the rounds and membership changes recorded against the epoch, and the batches lost
        in it with a sharded group (before the checkpoint: never handed out again, on any world)."""
        entry = self._open.get(epoch, _Epoch())
        seen: dict[int, int] = {}
        kept = []
        for chunk in entry.chunks:
            seen[chunk.rank] = seen.get(chunk.rank, 0) + 1
            if chunks is None or seen[chunk.rank] <= chunks.get(chunk.rank, 0):
                kept.append(asdict(chunk))
        return {
            "chunks": kept,
            "rounds_closed": entry.rounds_closed,
            "rounds": {rank: asdict(cost) for rank, cost in entry.rounds.items()},
            "membership": list(entry.membership),
            "step": self.step,
            "lost": entry.lost,
        }

    def resume_partial(self, epoch: int, state: Mapping[str, Any]) -> None:
        """A run resumed inside `epoch` (its first open one): its record starts from what the checkpoint's
        held (`partial`), so it is the uninterrupted run's."""
        entry = self._epoch(epoch)
        entry.chunks = [ChunkReport(**chunk) for chunk in state["chunks"]]
        entry.rounds_closed = int(state["rounds_closed"])
        entry.rounds = {int(rank): RoundCost(**cost) for rank, cost in state["rounds"].items()}
        entry.membership = list(state["membership"])
        self.step = int(state["step"])
        entry.lost = int(state.get("lost", 0))  # a checkpoint of an older flodl: none

    def add_chunk(self, chunk: ChunkReport) -> bool:
        """Record a chunk; True when it completes its epoch."""
        entry = self._epoch(chunk.epoch)
        entry.chunks.append(chunk)
        return self._check_complete(chunk.epoch, entry)

    def expect_batches(self, epoch: int, batches: int) -> None:
        """The epoch's batches were planned again (sync under survive: a member cut in it): it is complete
        once `batches` are reported (maybe already)."""
        entry = self._epoch(epoch)
        entry.batches = batches
        self._check_complete(epoch, entry)

    def lose_batches(self, epoch: int, batches: int) -> bool:
        """`batches` of the epoch were trained by a rank of a sharded group that died before reporting them
        (lost with the group; its others reported theirs): the epoch is complete without them, and its
        record leaves them out. True when that completes it."""
        entry = self._epoch(epoch)
        entry.lost += batches
        return self._check_complete(epoch, entry)

    def _check_complete(self, epoch: int, entry: _Epoch) -> bool:
        planned = (self.batches_per_epoch if entry.batches is None else entry.batches) - entry.lost
        done = sum(c.batches for c in entry.chunks)
        if done > planned:
            raise LedgerError(f"epoch {shown_epoch(epoch)}: {done} batches reported, {planned} planned")
        if done == planned and entry.completed_at is None:
            entry.completed_at = time.perf_counter()
            return True
        return False

    def add_eval(self, result: EvalResult) -> None:
        self._epoch(result.epoch).evals.append(result)

    def expect_eval(self, epoch: int, expected: bool, ranks: int | None = None) -> None:
        """Whether the epoch gets an eval, from how many ranks (None: world_size): each member at the
        evaluating round sends its shard's sums. Said again (the round redone among fewer members after a
        rank died), the eval starts afresh: results received for the aborted round are dropped."""
        entry = self._epoch(epoch)
        if entry.eval_expected is not None:
            entry.evals = []
        entry.eval_expected = expected
        entry.eval_ranks = self.world_size if ranks is None else ranks

    def membership_event(self, event: str, rank: int, timings: dict[str, float] | None = None) -> None:
        """A rank was cut or admitted: recorded, with `timings` (what the change cost, by name), under
        `membership` in the record of the oldest epoch not yet emitted (the epoch open, as open_round
        attributes a round); `at_s` counts from the ledger's start. After the last record (a rank lost
        while the run shuts down) no record carries it."""
        if event not in MEMBERSHIP_EVENTS:
            raise ValueError(f"membership event {event!r}: expected one of {', '.join(MEMBERSHIP_EVENTS)}")
        if (rank in self.members) != (event == "rank_cut"):
            raise LedgerError(f"{event} for rank {rank}, members {sorted(self.members)}")
        if not self.all_emitted:
            entry = self._epoch(min(self.next_to_emit, self.epochs - 1))
            at_s = time.perf_counter() - self.started_at
            timed = {"event": event, "rank": rank, "at_s": at_s, "timings": dict(timings or {})}
            entry.membership.append(timed)
        if event == "rank_cut":
            self.members.discard(rank)
        else:
            self.members.add(rank)

    def open_round(self, round_id: int) -> None:
        """A round began: its bytes belong to the oldest epoch not yet emitted, which waits for them."""
        epoch = min(self.next_to_emit, self.epochs - 1)
        self._round_epoch[round_id] = epoch
        self._epoch(epoch).rounds_open += 1

    def close_round(self, round_id: int, costs: dict[int, RoundCost]) -> None:
        entry = self._epoch(self._round_epoch.pop(round_id))
        entry.rounds_open -= 1
        entry.rounds_closed += 1
        for rank, cost in costs.items():
            entry.rounds[rank] = entry.rounds.get(rank, RoundCost()) + cost

    def end_after(self, last: int) -> None:
        """The run stops early: `last` is the last epoch any rank trains."""
        self.epochs = last + 1

    def release(self) -> None:
        """The run's last round is done: the last epoch may be emitted."""
        self.hold_last = False

    def emit_ready(self) -> list[EpochMetrics]:
        """Every epoch, in order, that is complete, has its eval (if any) and its rounds' bytes."""
        ready = []
        while self.next_to_emit < self.epochs:
            entry = self._open.get(self.next_to_emit)
            if entry is None or entry.completed_at is None or entry.eval_expected is None:
                break
            if entry.rounds_open or (entry.eval_expected and len(entry.evals) < entry.eval_ranks):
                break
            if self.hold_last and self.next_to_emit == self.epochs - 1:
                break
            since = self._last_finish if self._last_finish is not None else self.started_at
            # Async epochs overlap: one can complete before the epoch ahead of it. Finishes are taken in
            # epoch order (monotone), so every epoch_s is >= 0 and they sum to the run's wall time.
            finished = max(entry.completed_at, since)
            self._last_finish = finished
            metrics = aggregate_epoch(
                self.next_to_emit,
                entry.chunks,
                entry.evals,
                finished - since,
                entry.rounds,
                self.comm_bytes_total,
                entry.rounds_closed if self.local_sgd else self._ddp_steps(entry),
                self.world_size,
                self.overlapping,
                len(self.members),
                entry.membership,
                self.step,
            )
            self.comm_bytes_total, self.step = metrics.comm_bytes_total, metrics.step
            self._comm_bytes_after[self.next_to_emit] = self.comm_bytes_total
            ready.append(metrics)
            self._open.pop(self.next_to_emit - 1, None)
            self.next_to_emit += 1
        return ready

    def _ddp_steps(self, entry: _Epoch) -> int:
        """Without averaging rounds (sync over DDP) every optimizer step averages: one per batch of a rank
        that trained the whole epoch (each member steps with the others)."""
        per_rank: dict[int, int] = {}
        for chunk in entry.chunks:
            per_rank[chunk.rank] = per_rank.get(chunk.rank, 0) + chunk.batches
        return max(per_rank.values(), default=0)

    @property
    def all_emitted(self) -> bool:
        return self.next_to_emit == self.epochs
