"""The float8 recipes bench/float8_scaling.py probes before flodl takes them: each gives the gradients it
claims, on the CPU, so that GPU time measures a recipe that is right."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from bench.float8_scaling import patched
from flodl.tasks.chunked_ce import chunked_cross_entropy
from tests.helpers.float8 import CPU_FLOAT8


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@CPU_FLOAT8
@pytest.mark.parametrize("rows", [48, 40], ids=["whole-chunks", "short-last-chunk"])
def test_the_output_layers_weight_gradient_in_float8_is_close_to_the_exact_one(rows: int) -> None:
    """fp8-wgrad: the weight gradient multiplied in float8 (not flodl's work-dtype one), a few percent off
    the exact; a last chunk of 8 tokens (no multiple of 16) multiplies in the work dtype."""
    torch.manual_seed(0)
    hidden = torch.randn(rows, 32, requires_grad=True)
    weight = (torch.randn(64, 32) * 0.2).requires_grad_()
    targets = torch.randint(64, (rows,))
    want = torch.autograd.grad(F.cross_entropy(hidden @ weight.t(), targets), (hidden, weight))
    flodls = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, 16, float8=True), weight)[0]
    with patched("fp8-wgrad", argparse.Namespace()):
        loss = chunked_cross_entropy(hidden, weight, targets, 16, float8=True)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    assert _relative_error(grad_hidden, want[0]) < 0.15
    # e5m2 keeps 2 mantissa bits: the float8 weight gradient is further off than the work dtype's.
    assert _relative_error(flodls, want[1]) < _relative_error(grad_weight, want[1]) < 0.15
