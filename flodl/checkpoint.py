"""Writing model files atomically: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

MODEL_FILE = "model.pt"


def atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def save_model(model: nn.Module, path: Path) -> None:
    """The model's parameters and buffers as CPU tensors, loadable with weights_only=True."""
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    atomic_save(state, path)
