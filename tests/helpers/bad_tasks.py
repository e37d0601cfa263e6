"""Task parts a preflight must refuse before any rank starts: targets the config of a test names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    """Samples as a stream: no length, no index."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        for i in range(64):
            yield torch.zeros(64), i % 10


def stream() -> Stream:
    return Stream()


def sums_forgotten(model: nn.Module, batch: Any) -> None:
    """An eval_fn that computes its metric and forgets to return it."""
    inputs, labels = batch
    (model(inputs).argmax(dim=1) == labels).sum()
