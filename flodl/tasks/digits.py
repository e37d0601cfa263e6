"""The embedded default task: scikit-learn's handwritten digits (1,797 8x8 images, no download)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flodl.data.dataset import TensorDataSet

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def digits_dataset(split: str) -> TensorDataSet:
    """The train or test split: pixels scaled to [0, 1], a fixed 80/20 split by SPLIT_SEED."""
    if split not in ("train", "test"):
        raise ValueError(f"digits_dataset: split must be 'train' or 'test', got {split!r}")
    table = torch.as_tensor(np.loadtxt(_digits_file(), delimiter=","))
    inputs = table[:, :-1].float() / 16.0
    targets = table[:, -1].long()
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(targets) * TEST_FRACTION)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return TensorDataSet(inputs[chosen], targets[chosen])


def _digits_file() -> Path:
    """The table scikit-learn ships (64 pixels and the label a row), read as `load_digits` reads it but
    without importing scikit-learn: that import costs every process that loads the task (the launcher's
    preflight, each spawned rank) over a second."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("task=digits reads scikit-learn's digits: pip install scikit-learn")
    return Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int = 128, inputs: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(inputs, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
