"""Aggregate the ranks' per-chunk reports into one EpochMetrics record (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flodl.links.messages import ChunkReport, EvalResult
from flodl.metrics.scalars import mean_scalars


@dataclass(frozen=True)
class RoundCost:
    """What averaging rounds cost one rank: bytes sent, training time held up, steps trained meanwhile, and
    the rounds' own time from start to consensus (blocked_ms of it was exposed)."""

    payload_bytes: int = 0
    blocked_ms: float = 0.0
    steps_during: int = 0
    comm_ms: float = 0.0

    def __add__(self, other: RoundCost) -> RoundCost:
        return RoundCost(
            self.payload_bytes + other.payload_bytes,
            self.blocked_ms + other.blocked_ms,
            self.steps_during + other.steps_during,
            self.comm_ms + other.comm_ms,
        )


@dataclass(frozen=True)
class WorkSpan:
    """Samples one rank trained between two instants of its own clock, in `busy_s` of training time."""

    rank: int
    start: float
    end: float
    samples: int
    busy_s: float


def common_window_rate(spans: Sequence[WorkSpan]) -> float:
    """Samples per second over the common window of `spans`: from the first start to the last end.

    Every sample counted was trained inside the window (work of other spans that falls in it is not
    counted, so the rate errs low), and the window is never shorter than any rank's own training time, so
    the rate never exceeds the sum of the ranks' own rates (samples over busy time). Async epochs overlap,
    so an epoch's clock on rank 0 (`epoch_s`) is no window for its samples.
    """
    if not spans:
        return 0.0
    busy: dict[int, float] = {}
    for span in spans:
        busy[span.rank] = busy.get(span.rank, 0.0) + span.busy_s
    window = max(max(s.end for s in spans) - min(s.start for s in spans), *busy.values())
    return sum(s.samples for s in spans) / window if window > 0 else 0.0


@dataclass
class RankShare:
    rank: int
    batches: int
    samples: int
    batch_share: float
    # The rank's own speed: samples over the time it spent on them (busy_s: waits excluded).
    samples_per_s: float
    data_ms: float
    # Bytes the rank put on the wire this epoch (after compression).
    comm_bytes: int
    # Time averaging rounds held up the rank's training, and steps it trained while rounds were in flight.
    averaging_blocked_ms: float = 0.0
    steps_during_averaging: int = 0
    busy_s: float = 0.0
    # The rounds' own time, start to consensus (with overlap_rounds mostly hidden behind training).
    averaging_comm_ms: float = 0.0


@dataclass
class EpochMetrics:
    epoch: int
    # Optimizer steps the busiest rank has taken so far, a rank cut since included (under sync: the global
    # step count); it never goes back.
    step: int
    # Batch-weighted mean training loss over every rank's batches.
    loss: float
    samples: int
    # Wall time from the previous epoch's completion (or the run's start) to this one's.
    epoch_s: float
    # samples / (epoch_s - compile_s); async (epochs overlap): over the common window of the epoch's work
    # instead. A compiled model's first step is reported apart (compile_s), not hidden here.
    samples_per_s: float
    # The longest first step of a compiled model among the ranks (compile=true: the first epoch trained
    # by this process; 0 otherwise).
    compile_s: float = 0.0
    # Rank 0's learning rate at the end of its last chunk of the epoch.
    lr: float = 0.0
    # Averaging rounds this epoch (under sync: optimizer steps, each averages the gradients).
    rounds: int = 0
    # Bytes all ranks put on the wire this epoch, and since the start of the run.
    comm_bytes: int = 0
    comm_bytes_total: int = 0
    eval: dict[str, float] = field(default_factory=dict)
    # What the evaluated model was trained on (see EvalResult); None without an eval. Under async the eval
    # runs on the consensus of a later round than the epoch's end, and these say which.
    eval_step: int | None = None
    eval_samples: int | None = None
    # Where the eval stands on the run's axes (None without one): `step`'s count when its model was taken
    # (the busiest member's own steps in it) and when the last member took it up (unix seconds, the ranks'
    # clocks). Under async that is after the epoch's end; the console, W&B and the compare plot show the
    # eval there.
    eval_at_step: int | None = None
    eval_taken_at: float | None = None
    # record_scalar values: per-epoch means over every rank's records.
    scalars: dict[str, float] = field(default_factory=dict)
    per_rank: list[RankShare] = field(default_factory=list)
    # The epoch's work on the ranks' clocks (unix seconds): its first step's start, its last step's end.
    window_start: float = 0.0
    window_end: float = 0.0
    # The ranks that were members when the record was emitted, after every membership change it lists
    # (the world size unless a rank was cut). Not the ranks that trained in the epoch: a healthy async rank
    # can skip an epoch, and a rank cut mid-epoch trained part of it (per_rank shows who trained what).
    world: int = 0
    # Membership changes while this was the oldest epoch not yet emitted (rank_cut, rank_admitted).
    membership: list[dict[str, Any]] = field(default_factory=list)
    # samples_per_s in tokens (a token task's; else None), and as model FLOPs utilisation: the share of the
    # peak FLOPS of the devices that trained in the epoch (None: a device's peak is not known).
    tokens_per_s: float | None = None
    mfu: float | None = None
    # The share of the ranks' training time spent waiting for data, and the most device memory a rank
    # allocated in the epoch (bytes; 0 on the CPU).
    data_wait: float = 0.0
    peak_memory: int = 0

    def as_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("eval")
        record.update({f"eval/{k}": v for k, v in self.eval.items()})
        return record


def aggregate_epoch(
    epoch: int,
    chunks: list[ChunkReport],
    evals: list[EvalResult],
    wall_s: float,
    round_costs: dict[int, RoundCost] | None = None,
    comm_before: int = 0,
    rounds: int = 0,
    world_size: int = 0,
    overlapping: bool = False,
    members: int | None = None,
    membership: list[dict[str, Any]] | None = None,
    step_before: int = 0,
) -> EpochMetrics:
    """One epoch from its chunks and evals. `round_costs`: per rank, the cost of the averaging rounds
    attributed to this epoch; `comm_before`: the run's bytes on the wire before this epoch; `rounds`: how
    many averaging rounds the epoch counts; `overlapping`: epochs overlap (async), so the throughput is
    taken over the epoch's common window; `members` (None: `world_size`) and `membership`: the record's
    `world` and membership changes; `step_before`: the busiest rank's steps before this epoch (a rank that
    was the busiest may have been cut since: its steps were still taken)."""
    if not chunks:
        raise ValueError(f"epoch {epoch}: no metrics reported")
    batches = sum(c.batches for c in chunks)
    samples = sum(c.samples for c in chunks)
    shares = rank_shares(chunks, round_costs or {}, world_size)
    comm = sum(share.comm_bytes for share in shares)
    compile_s = max(c.compile_s for c in chunks)
    spans = [WorkSpan(c.rank, c.started_at, c.ended_at, c.samples, c.wall_ms / 1000) for c in chunks]
    training_s = wall_s - compile_s
    per_epoch_s = samples / training_s if training_s > 0 else 0.0
    rate = common_window_rate(spans) if overlapping else per_epoch_s
    tokens = chunks[0].tokens_per_sample
    peaks = {c.rank: c.peak_flops for c in chunks}
    known = chunks[0].flops_per_sample > 0 and all(p > 0 for p in peaks.values())
    busy_ms = sum(c.wall_ms for c in chunks)
    return EpochMetrics(
        epoch=epoch,
        step=max(step_before, *(c.steps_total for c in chunks)),
        # Each step's loss weighs its samples: a resume with keep_global_batch steps more of them at once.
        loss=sum(c.loss_sum * c.samples / c.batches for c in chunks if c.batches) / samples
        if batches
        else float("nan"),
        samples=samples,
        epoch_s=wall_s,
        samples_per_s=rate,
        compile_s=compile_s,
        lr=max(chunks, key=lambda c: (c.rank == 0, c.steps_total)).lr,
        rounds=rounds,
        comm_bytes=comm,
        comm_bytes_total=comm_before + comm,
        eval=aggregate_eval(evals),
        eval_step=evals[0].step if evals else None,
        eval_samples=evals[0].samples if evals else None,
        eval_at_step=max(e.own_steps for e in evals) if evals else None,
        eval_taken_at=max(e.taken_at for e in evals) if evals else None,
        scalars=mean_scalars([c.scalars for c in chunks]),
        per_rank=shares,
        window_start=min(s.start for s in spans),
        window_end=max(s.end for s in spans),
        world=world_size if members is None else members,
        membership=list(membership or []),
        tokens_per_s=rate * tokens if tokens else None,
        mfu=rate * chunks[0].flops_per_sample / sum(peaks.values()) if known else None,
        data_wait=sum(c.data_ms for c in chunks) / busy_ms if busy_ms > 0 else 0.0,
        peak_memory=max(c.peak_memory for c in chunks),
    )


def rank_shares(
    chunks: list[ChunkReport], round_costs: dict[int, RoundCost], world_size: int
) -> list[RankShare]:
    """Each rank's part of the epoch, in rank order: every rank of the world and of `round_costs` has one,
    also a rank that trained nothing this epoch (async may skip past an epoch)."""
    batches = sum(c.batches for c in chunks)
    per_rank: dict[int, list[ChunkReport]] = {r: [] for r in [*range(world_size), *round_costs]}
    for chunk in chunks:
        per_rank.setdefault(chunk.rank, []).append(chunk)
    shares = []
    for rank, mine in sorted(per_rank.items()):
        busy_s = sum(c.wall_ms for c in mine) / 1000
        rank_batches = sum(c.batches for c in mine)
        rank_samples = sum(c.samples for c in mine)
        cost = round_costs.get(rank, RoundCost())
        shares.append(
            RankShare(
                rank=rank,
                batches=rank_batches,
                samples=rank_samples,
                batch_share=rank_batches / batches if batches else 0.0,
                samples_per_s=rank_samples / busy_s if busy_s > 0 else 0.0,
                data_ms=sum(c.data_ms for c in mine),
                comm_bytes=sum(c.comm_bytes for c in mine) + cost.payload_bytes,
                averaging_blocked_ms=cost.blocked_ms,
                steps_during_averaging=cost.steps_during,
                busy_s=busy_s,
                averaging_comm_ms=cost.comm_ms,
            )
        )
    return shares


def aggregate_eval(evals: list[EvalResult]) -> dict[str, float]:
    """Per-sample means over the whole eval set from the ranks' per-shard sums."""
    count = sum(e.count for e in evals)
    if count == 0:
        return {}
    totals: dict[str, float] = {}
    for result in evals:
        for name, value in result.sums.items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: total / count for name, total in totals.items()}
