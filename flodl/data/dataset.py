"""BatchDataSet: a dataset that serves whole batches by index.

Contract: `len()` samples, `get_batch(indices) -> list[Tensor]` (one tensor per field, first dim =
len(indices)), and purity: the same index always gives the same bytes. Any torch map-style Dataset
adapts to it with `as_batch_dataset`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


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


class MapDataSet:
    """Adapts a torch map-style Dataset whose items are tensors or tuples of tensors."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def get_batch(self, indices: Tensor) -> list[Tensor]:
        rows = [_as_fields(self.dataset[int(i)]) for i in indices.tolist()]
        return [torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in range(len(rows[0]))]


def _as_fields(item: Any) -> Sequence[Any]:
    return item if isinstance(item, (tuple, list)) else (item,)


def as_batch_dataset(data: Any, what: str) -> BatchDataSet:
    """The BatchDataSet for a user-provided dataset; `what` names the config key in errors."""
    if isinstance(data, BatchDataSet):
        dataset = data
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        dataset = MapDataSet(data)
    else:
        raise TypeError(
            f"{what}: {type(data).__name__} is neither a BatchDataSet (len + get_batch) nor a "
            "map-style Dataset (len + __getitem__)"
        )
    if len(dataset) == 0:
        raise ValueError(f"{what}: the dataset is empty")
    return dataset


def check_purity(dataset: BatchDataSet, what: str, samples: int = 4) -> None:
    """The purity contract, checked once (debug.check_purity=true): fetching the same indices twice gives the
    same bytes. Augmentation belongs in `task.transform`, never in the dataset."""
    indices = torch.arange(min(samples, len(dataset)))
    first, second = dataset.get_batch(indices), dataset.get_batch(indices)
    if len(first) != len(second) or not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)):
        raise ValueError(
            f"{what}: two reads of samples {indices.tolist()} differ; a dataset must give the same bytes "
            "for the same index (augment in task.transform instead)"
        )
