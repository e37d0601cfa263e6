"""The data plane as a worker sees it: one `Feeder`, chosen once for the training data by `feeder_for`.

    a BatchDataSet       ─▶ BatchFeeder  (flodl/data/feeder.py: tiers, stager, device pool, prefetch)
    a map-style Dataset  ─▶ SampleFeeder (flodl/data/sample_feed.py: torch's DataLoader over the read plan)
    an IterableDataset   ─▶ StreamFeeder (flodl/data/stream.py: the rank's readers, in order)

The stepper and a rank's checkpoint ask the feeder, never which one it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from flodl.data.augment import Transform
from flodl.data.dataset import is_batch_dataset, is_stream
from flodl.data.feeder import BatchFeeder, DataPlaneSettings, staging_tiers
from flodl.data.sample_feed import SampleFeeder
from flodl.data.stream import StreamFeeder
from flodl.data.tiers import FeedStats


class Feeder(Protocol):
    """Where a worker's batches come from."""

    # A stream's: read in order, so a pick is a place in its epoch (the rank trains the next items of its
    # shard, whichever they are), and where its readers stand is part of the rank's checkpoint (`state`).
    # Otherwise a pick names a sample's view and the picks say all a resumed rank needs.
    in_order: bool
    stats: FeedStats

    def advise(self, epoch: int, picks: Tensor) -> None:
        """The worker will train these picks of `epoch` next (after what it was advised before)."""
        ...

    def load(self, picks: Tensor, epoch: int) -> Any:
        """The batch of `picks` of `epoch` on the device."""
        ...

    def state(self) -> dict[str, Any] | None:
        """What a rank's checkpoint keeps of where the reads stand (None: nothing beyond the picks)."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """Continue where a checkpoint's `state` stood (before the first batch is read)."""
        ...

    def close(self) -> None: ...


def feeder_for(
    settings: DataPlaneSettings,
    dataset: Any,
    device: torch.device,
    collate: Callable[[list[Any]], Any],
    transform: Transform | None = None,
    cacheable: bool = True,
) -> Feeder:
    """The feeder of `dataset` (the task's train_data): a stream's, a BatchDataSet's, or a map-style
    Dataset's (`cacheable`: read through the RAM and disk tiers)."""
    if is_stream(dataset):
        return StreamFeeder(settings, dataset, device, collate)
    if is_batch_dataset(dataset):
        return BatchFeeder(settings, dataset, device, transform, cacheable)
    tiers = staging_tiers(settings) if cacheable else None
    return SampleFeeder(settings, dataset, device, collate, tiers, transform)
