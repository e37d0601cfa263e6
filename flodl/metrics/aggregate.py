"""Aggregate the ranks' per-chunk reports into one EpochMetrics record (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flodl.runtime.messages import EvalResult, Metrics


@dataclass
class RankShare:
    rank: int
    batches: int
    samples: int
    batch_share: float
    # The rank's own speed: samples over the time it spent on them (waits excluded).
    samples_per_s: float
    data_ms: float


@dataclass
class EpochMetrics:
    epoch: int
    # Optimizer steps taken by each rank so far (under sync: the global step count).
    step: int
    # Batch-weighted mean training loss over every rank's batches.
    loss: float
    samples: int
    # Wall time from the previous epoch's completion (or the run's start) to this one's.
    epoch_s: float
    samples_per_s: float
    eval: dict[str, float] = field(default_factory=dict)
    per_rank: list[RankShare] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("eval")
        record.update({f"eval/{k}": v for k, v in self.eval.items()})
        return record


def aggregate_epoch(
    epoch: int, chunks: list[Metrics], evals: list[EvalResult], wall_s: float
) -> EpochMetrics:
    if not chunks:
        raise ValueError(f"epoch {epoch}: no metrics reported")
    batches = sum(c.batches for c in chunks)
    samples = sum(c.samples for c in chunks)
    per_rank: dict[int, list[Metrics]] = {}
    for chunk in chunks:
        per_rank.setdefault(chunk.rank, []).append(chunk)
    busy_s = {r: sum(c.wall_ms for c in cs) / 1000 for r, cs in per_rank.items()}
    shares = [
        RankShare(
            rank=r,
            batches=sum(c.batches for c in cs),
            samples=sum(c.samples for c in cs),
            batch_share=sum(c.batches for c in cs) / batches if batches else 0.0,
            samples_per_s=sum(c.samples for c in cs) / busy_s[r] if busy_s[r] > 0 else 0.0,
            data_ms=sum(c.data_ms for c in cs),
        )
        for r, cs in sorted(per_rank.items())
    ]
    return EpochMetrics(
        epoch=epoch,
        step=max(c.steps_total for c in chunks),
        loss=sum(c.loss_sum for c in chunks) / batches if batches else float("nan"),
        samples=samples,
        epoch_s=wall_s,
        samples_per_s=samples / wall_s if wall_s > 0 else 0.0,
        eval=aggregate_eval(evals),
        per_rank=shares,
    )


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
