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
