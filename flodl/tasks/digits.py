"""The embedded default task: scikit-learn's handwritten digits (1,797 8x8 images, no download)."""

from __future__ import annotations

import torch
from torch import nn

from flodl.data.dataset import TensorDataSet

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def digits_dataset(split: str) -> TensorDataSet:
    """The train or test split: pixels scaled to [0, 1], a fixed 80/20 split by SPLIT_SEED."""
    if split not in ("train", "test"):
        raise ValueError(f"digits_dataset: split must be 'train' or 'test', got {split!r}")
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    inputs = torch.as_tensor(images, dtype=torch.float32) / 16.0
    targets = torch.as_tensor(labels, dtype=torch.long)
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(targets) * TEST_FRACTION)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return TensorDataSet(inputs[chosen], targets[chosen])


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
