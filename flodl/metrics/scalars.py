"""`record_scalar(name, value)`: extra per-step values from inside a user's loss function.

Values accumulate as (sum, count) on the device, without a host read; the worker drains them into each
chunk report (one read per chunk) and rank 0 reports the per-epoch mean over every rank's records.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor

_local = threading.local()


def _store() -> dict[str, list]:
    if not hasattr(_local, "sums"):
        _local.sums = {}
    return _local.sums


def record_scalar(name: str, value: Tensor | float) -> None:
    """Add one observation of `name`; a tensor stays on its device until the chunk is reported."""
    entry = _store().setdefault(name, [0.0, 0])
    entry[0] = entry[0] + (value.detach().float() if isinstance(value, Tensor) else float(value))
    entry[1] += 1


@contextmanager
def scalars_ignored() -> Iterator[None]:
    """Within: what `record_scalar` records is dropped (a pass that is no training step: FLOPs counting)."""
    kept = {name: list(entry) for name, entry in _store().items()}
    try:
        yield
    finally:
        _local.sums = kept


def drain_scalars() -> dict[str, list[float]]:
    """Every recorded (sum, count) since the last drain, read to the host; resets the accumulator."""
    store = _store()
    drained = {name: [float(total), float(count)] for name, (total, count) in store.items()}
    store.clear()
    return drained


def mean_scalars(parts: list[dict[str, list[float]]]) -> dict[str, float]:
    """Per-name means over several drained (sum, count) dicts."""
    totals: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, count) in part.items():
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += total
            acc[1] += count
    return {name: total / count for name, (total, count) in totals.items() if count}
