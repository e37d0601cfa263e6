"""The two kinds of training data.

A BatchDataSet serves whole batches by index: `len()` samples, `get_batch(indices) -> list[Tensor]` (one
tensor per field, first dim = len(indices)), and purity: the same index always gives the same bytes, so
its samples are cached. A torch map-style Dataset serves samples of any structure through `__getitem__`,
batched by `task.collate_fn`; it is read afresh every epoch unless declared cacheable (`task.cacheable`).
A torch IterableDataset (a stream) trains too, read in order by flodl/data/stream.py; never for eval.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from flodl.data.sample import same


@runtime_checkable
class BatchDataSet(Protocol):
    def __len__(self) -> int: ...

    def get_batch(self, indices: Tensor) -> list[Tensor]: ...


class TensorDataSet:
    """Fields held as tensors with a common first dimension; batches are index gathers."""

    # Already in process memory: the staging tiers would only copy it.
    resident = True

    def __init__(self, *fields: Tensor) -> None:
        if not fields:
            raise ValueError("TensorDataSet needs at least one tensor")
        sizes = {int(f.shape[0]) for f in fields}
        if len(sizes) != 1:
            raise ValueError(f"TensorDataSet fields disagree on length: {[f.shape[0] for f in fields]}")
        self.fields = fields

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    def get_batch(self, indices: Tensor) -> list[Tensor]:
        return [f.index_select(0, indices) for f in self.fields]


def is_batch_dataset(data: Any) -> bool:
    return isinstance(data, BatchDataSet)


def is_stream(data: Any) -> bool:
    """A torch IterableDataset: items in order, no length, no index (flodl/data/stream.py reads it)."""
    return isinstance(data, torch.utils.data.IterableDataset)


def as_dataset(data: Any, what: str, streams: bool = False) -> Any:
    """A user-provided dataset, checked: a BatchDataSet, or a torch map-style Dataset (len + __getitem__)
    whose samples `collate_fn` batches, or (`streams`: training data) an IterableDataset; `what` names the
    config key in errors."""
    if is_stream(data):
        if streams:
            return data
        raise TypeError(
            f"{what}: {type(data).__name__} is an IterableDataset (a stream), which flodl reads for training "
            "only (task.train_data with steps_per_epoch): the eval splits its set among the ranks by index; "
            "give a map-style Dataset (__len__ and __getitem__) or a BatchDataSet (len + get_batch)"
        )
    if not is_batch_dataset(data) and not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(
            f"{what}: {type(data).__name__} is neither a BatchDataSet (len + get_batch) nor a "
            "map-style Dataset (len + __getitem__)"
        )
    if len(data) == 0:
        raise ValueError(f"{what}: the dataset is empty")
    return data


def read_batch(data: Any, indices: Tensor, collate: Callable[[list[Any]], Any]) -> Any:
    """The batch of `indices` on the host: a BatchDataSet's get_batch, else the collated samples."""
    if is_batch_dataset(data):
        return data.get_batch(indices)
    return collate([data[i] for i in indices.tolist()])


def check_purity(dataset: Any, what: str, samples: int = 4) -> None:
    """The purity contract of a cached dataset, checked once (debug.check_purity=true): reading the same
    samples twice gives the same bytes. Augmentation belongs in `task.transform`, or leave it uncached."""
    indices = torch.arange(min(samples, len(dataset)))
    if is_batch_dataset(dataset):
        first, second = dataset.get_batch(indices), dataset.get_batch(indices)
    else:
        first, second = [dataset[i] for i in indices.tolist()], [dataset[i] for i in indices.tolist()]
    if not same(first, second):
        raise ValueError(
            f"{what}: two reads of samples {indices.tolist()} differ; a cached dataset must give the same "
            "bytes for the same index (augment in task.transform, or set task.cacheable=false)"
        )
