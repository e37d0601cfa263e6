"""Where float8 matmuls run, as skip marks: this torch's CPU kernels (the CPU tests of flodl/worker/float8.py)
and a GPU that precision=fp8 accepts (compute capability 8.9+, the rule in flodl/config/rules/host_fit.py)."""

from __future__ import annotations

import pytest
import torch

from flodl.config.host import float8_matmul, gpu_capability
from flodl.config.rules.host_fit import FP8_CAPABILITY


def _cpu_float8_matmuls() -> bool:
    try:
        one = torch.ones((), dtype=torch.float32)
        a = torch.zeros(16, 16).to(torch.float8_e5m2)
        b = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


CPU_FLOAT8 = pytest.mark.skipif(
    not _cpu_float8_matmuls(), reason="this torch has no float8 matmuls on the CPU"
)
GPU_FLOAT8 = pytest.mark.skipif(
    not torch.cuda.is_available() or not float8_matmul() or (gpu_capability() or (0, 0)) < FP8_CAPABILITY,
    reason="needs a GPU with float8 matmuls (compute capability 8.9+)",
)

# A small GPT on the stdlib's bytes (widths multiples of 16 for the float8 matmuls), short enough for a
# test: 2 epochs of 2 MB in windows of 256 bytes, 64 windows a step.
SMALL_GPT = (
    "task=gpt2_small",
    "task.model.layers=2",
    "task.model.dim=256",
    "task.model.heads=4",
    "task.model.context=256",
    "task.model.amp=false",
    "task.train_data.max_bytes=2000000",
    "task.eval_data.max_bytes=200000",
    "task.scheduler.warmup_steps=10",
    "task.scheduler.total_steps=500",
    "batch_size=32",
    "epochs=2",
    "eval_every=1",
)
