"""A user's own project, as a person writes one next to an installed flodl: a package of their own (`mypkg`:
a model, a dataset factory, a loss) and a `conf/` whose task names it (`task=blobs` with `--config-dir conf`).
"""

from __future__ import annotations

from pathlib import Path

PARTS = """
import torch
import torch.nn.functional as F
from torch import nn

from flodl.data.dataset import TensorDataSet


class Net(nn.Module):
    def __init__(self, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, 2))
        self.dropout = dropout

    def forward(self, x):
        return self.net(x)


def blobs(n: int) -> TensorDataSet:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (n,), generator=generator)
    return TensorDataSet(torch.randn(n, 4, generator=generator) + 2 * labels[:, None].float(), labels)


def loss(model, batch):
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)
"""

TASK = """# @package _global_
epochs: 2
batch_size: 16
task:
  name: blobs
  model: {_target_: mypkg.parts.Net, width: 8}
  train_data: {_target_: mypkg.parts.blobs, n: 256}
  eval_data: null
  loss: {_target_: mypkg.parts.loss, _partial_: true}
  optimizer: {_target_: torch.optim.SGD, _partial_: true, lr: 0.1}
"""


def write_project(root: Path) -> Path:
    """The project in `root` (made): `mypkg/` and `conf/task/blobs.yaml`; returns `root`."""
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "parts.py").write_text(PARTS)
    (root / "conf" / "task").mkdir(parents=True)
    (root / "conf" / "task" / "blobs.yaml").write_text(TASK)
    return root
