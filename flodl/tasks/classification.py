"""Loss and eval functions for classification tasks whose batches are `[inputs, labels]`."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def cross_entropy_loss(model: nn.Module, batch: list[Tensor]) -> Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def classification_sums(model: nn.Module, batch: list[Tensor]) -> dict[str, Tensor]:
    """Per-batch sums; the framework divides by the number of eval samples."""
    inputs, labels = batch
    logits = model(inputs)
    return {
        "accuracy": (logits.argmax(dim=1) == labels).sum(),
        "loss": F.cross_entropy(logits, labels, reduction="sum"),
    }
