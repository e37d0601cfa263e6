"""Typed control and report messages, encoded as JSON (never pickle).

Worker -> coordinator: Metrics (one per chunk), EvalResult, Exiting.
Coordinator -> worker: StartEpoch (the rank's slice of the epoch), Shutdown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StartEpoch:
    epoch: int
    offset: int
    size: int
    # Evaluate the model after this epoch and report an EvalResult.
    evaluate: bool = False


@dataclass
class Shutdown:
    reason: str = "done"


@dataclass
class Metrics:
    rank: int
    epoch: int
    batches: int
    samples: int
    # Sum over batches of the batch-mean loss (the loss is reported batch-weighted).
    loss_sum: float
    # Wall time of the chunk on this rank, and the part spent waiting for data.
    wall_ms: float
    data_ms: float
    steps_total: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EvalResult:
    rank: int
    epoch: int
    # Per-metric sums over this rank's share of the eval set, and that share's size.
    sums: dict[str, float]
    count: int


@dataclass
class Exiting:
    rank: int


Message = StartEpoch | Shutdown | Metrics | EvalResult | Exiting
_TYPES: dict[str, type] = {t.__name__: t for t in (StartEpoch, Shutdown, Metrics, EvalResult, Exiting)}


class MessageError(ValueError):
    pass


def encode(message: Message) -> bytes:
    return json.dumps({"type": type(message).__name__, "body": asdict(message)}).encode()


def decode(raw: bytes) -> Message:
    try:
        data: dict[str, Any] = json.loads(raw)
        return _TYPES[data["type"]](**data["body"])
    except (KeyError, TypeError, ValueError, RecursionError) as err:
        raise MessageError(f"undecodable flodl message {raw[:200]!r}: {err}") from err
