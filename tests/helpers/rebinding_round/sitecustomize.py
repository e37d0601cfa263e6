"""A test double, loaded at start-up by every Python process that has this folder on PYTHONPATH: the
device averager adopts each round's consensus and then rebinds the model's parameters to new tensors
holding it, instead of leaving them where they were (what must never happen under a compile mode that
captures CUDA graphs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flodl.averaging.consensus import DeviceAverager

_init = DeviceAverager.__init__
_adopt = DeviceAverager.adopt
_models: dict[int, nn.Module] = {}


def _keeping_init(self: DeviceAverager, model: nn.Module, *args: Any, **kwargs: Any) -> None:
    _init(self, model, *args, **kwargs)
    _models[id(self)] = model


def _rebinding_adopt(self: DeviceAverager, *args: Any) -> None:
    _adopt(self, *args)
    with torch.no_grad():
        for param in _models[id(self)].parameters():
            param.data = param.data.clone()


DeviceAverager.__init__ = _keeping_init  # type: ignore[method-assign]
DeviceAverager.adopt = _rebinding_adopt  # type: ignore[method-assign]
