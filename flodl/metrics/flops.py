"""Model FLOPs utilisation (MFU): the arithmetic a training step needs, against what the devices could do.

MFU = samples/s * model FLOPs per sample / (Σ over the ranks of one device's peak FLOPS). "Model FLOPs" are
those of the model as written, forward and backward, nothing recomputed counted (the usual accounting of
large-model papers), so MFU compares runs, frameworks and settings fairly.

- FLOPs per sample: the model's own formula when it has one (`train_flops(batch)`, e.g. 6N + 12·L·d·T per
  token for a GPT), else three times its forward pass as torch's FlopCounterMode counts it on the first
  batch (the backward pass costs about twice the forward): the task's loss is called once more on that
  batch, without gradients, in eval mode, its random draws and `record_scalar` values left out.
- Peak: a device's dense bf16 tensor-core throughput, from the table below by the CUDA device's name;
  `peak_tflops` sets it (a device not in the table, or another convention). No CUDA device, or one not in
  the table and no override: MFU is not known, and the run says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flodl.metrics.scalars import scalars_ignored

# Dense bf16 tensor-core TFLOPS by device name (the vendor's datasheet figures, without sparsity). Looked up
# by the first entry contained in torch.cuda.get_device_name(): longer names first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """One `device`'s peak FLOPS for MFU (None: not known)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for known, tflops in PEAK_BF16_TFLOPS:
        if known in name:
            return tflops * 1e12
    return None


def train_flops_per_sample(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, samples: int
) -> float:
    """Model FLOPs of one training step per sample of `batch` (`samples` of them): the model's formula, or
    three forward passes counted. Counting leaves no trace: no gradient, no running statistics, the random
    streams where they were."""
    formula = getattr(model, "train_flops", None)
    if formula is not None:
        return float(formula(batch)) / samples
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    was_training = model.training
    counter = FlopCounterMode(display=False)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), scalars_ignored(), counter:
            model.eval()
            loss_fn(model, batch)
    finally:
        model.train(was_training)
    return 3.0 * counter.get_total_flops() / samples
