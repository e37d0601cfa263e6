"""precision=fp8: the model's linear layers multiply in float8 (torch._scaled_mm), scaled per tensor.

Each matmul of a converted nn.Linear casts its operands to float8 with a scale from their current absolute
maximum (inputs and weights e4m3, gradients e5m2, as float8 training recipes do) and accumulates in higher
precision; the output and gradients come back in the input's dtype (bf16 under autocast). torch.compile
fuses the amax and casts into the neighbouring kernels.

The conversion swaps a module's class and nothing else: its weight and bias stay the same Parameter objects,
read at every call, so the flat buffers (flodl/averaging/flat.py), the optimizer, DDP and captured CUDA
graphs keep pointing at what trains. Layers whose weight another module shares (a tied output layer), those
whose sizes float8 matmuls cannot take (multiples of 16) and those a model marked `float8 = False` (where it
measured float8 slower, flodl/tasks/gpt.py's `float8_blocks`) stay as they are. A module with a
`use_float8()` method is told to run its own matmuls in float8 (the GPT's tied output layer, inside its
chunked loss).

At width 768 these per-tensor casts cost more than the faster matmuls save, while the 50k-wide output
layer's matmuls gain (bench/results/2026-12-04-gpt2-124m-mfu-fp8-1x-NVIDIA-H200.md, torchao's casts too).
Delayed scaling (`convert_to_float8(delayed=True)`: each cast takes the maximum seen the step before, so it
runs in its producer's kernel) pays in the blocks: 1.12x bf16 on GPT-2-124M, 1.09x on gpt2_small
(bench/results/2026-12-05-float8-scaling-1x-NVIDIA-H200.md). It is not precision=fp8's recipe yet: its
maxima are not saved in checkpoints, and its loss on a real corpus is not measured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# float8 matmuls take sizes in multiples of this (cuBLASLt's rule, which torch._scaled_mm enforces).
FLOAT8_MULTIPLE = 16


def _to_float8(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`t` scaled so that its absolute maximum is float8's, cast; and the scale that undoes it (float32)."""
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    return _cast(t, torch.finfo(dtype).max / amax, dtype)


def _cast(t: Tensor, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`t` times `scale`, saturated at float8's maximum and cast; and the scale that undoes it."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def _column_major(t: Tensor) -> Tensor:
    return t.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    """x (rows, in) @ weight (out, in).T in float8, both passes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        x8, x_inv = _to_float8(x, E4M3)
        w8, w_inv = _to_float8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.weight_dtype = weight.dtype
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        g8, g_inv = _to_float8(grad, E5M2)
        return _float8_grads(ctx.saved_tensors, ctx.weight_dtype, g8, g_inv, grad.dtype)


def _float8_grads(
    saved: tuple[Tensor, ...], weight_dtype: torch.dtype, g8: Tensor, g_inv: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The input's gradient (in `dtype`) and the weight's (in `weight_dtype`) from the output's, cast
    (`g8`), and the casts forward saved first (x8, x_inv, w8, w_inv)."""
    x8, x_inv, w8, w_inv = saved[:4]
    grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=dtype)
    grad_w = torch._scaled_mm(
        g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32
    )
    return grad_x, grad_w.to(weight_dtype)


# Delayed scaling: what the previous step's absolute maximum is multiplied by for this step's scale, so that
# values may grow this much in one step before they saturate.
_HEADROOM = 2.0
# The first step's absolute maxima, before any was seen: inputs (layer norm and GELU outputs are a few units)
# and gradients (far below 1). Too high costs low values precision for that step, too low saturates it.
_FIRST_SEEN = {E4M3: 64.0, E5M2: 1.0}


def _to_float8_as_seen(t: Tensor, seen: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`t` cast with the scale of the absolute maximum `seen` before; the inverse scale, and `t`'s own
    absolute maximum (for the next step). The maximum is taken per row first: that reduction runs in the
    cast's pass (and its producer's: a layer norm, a GELU), leaving one small reduction over the rows."""
    cast, inverse = _cast(t, torch.finfo(dtype).max / (seen * _HEADROOM), dtype)
    return cast, inverse, t.detach().abs().amax(dim=-1).max().float().clamp(min=1e-12)


class _DelayedFloat8Matmul(torch.autograd.Function):
    """As _Float8Matmul, the input and the gradient scaled by the maxima their module saw the step before
    (`seen_input`, `seen_grad`: 0-dim buffers, updated here); the weight, small, by its own. Each buffer is
    written whole: torch.compile (inductor) let a backward pass read an in-place update of one element of a
    shared buffer before it was due (its gradient measured 100x off)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, seen_input: Tensor, seen_grad: Tensor) -> Tensor:
        x8, x_inv, x_amax = _to_float8_as_seen(x, seen_input, E4M3)
        seen_input.copy_(x_amax)
        w8, w_inv = _to_float8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv, seen_grad)
        ctx.weight_dtype = weight.dtype
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # read before seen_grad's update below (autograd checks its version)
        g8, g_inv, g_amax = _to_float8_as_seen(grad, saved[4], E5M2)
        saved[4].copy_(g_amax)
        return *_float8_grads(saved, ctx.weight_dtype, g8, g_inv, grad.dtype), None, None


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in float8 (made by `convert_to_float8`, never built directly)."""

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            rows = x.reshape(-1, self.in_features).to(dtype)
            out = self._matmul(rows)
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: Tensor) -> Tensor:
        return _Float8Matmul.apply(rows, self.weight)


class DelayedFloat8Linear(Float8Linear):
    """A Float8Linear whose input and gradient take the scales of the step before (`float8_seen_*`
    buffers, not saved: a resumed run's first step guesses as the first run's did)."""

    def _matmul(self, rows: Tensor) -> Tensor:
        return _DelayedFloat8Matmul.apply(rows, self.weight, self.float8_seen_input, self.float8_seen_grad)

    def take_delayed_scaling(self) -> None:
        device = self.weight.device
        for name, dtype in (("float8_seen_input", E4M3), ("float8_seen_grad", E5M2)):
            self.register_buffer(name, torch.tensor(_FIRST_SEEN[dtype], device=device), persistent=False)


def convert_to_float8(model: nn.Module, delayed: bool = False) -> list[str]:
    """Turn `model`'s eligible nn.Linear modules into Float8Linear in place (`delayed`: DelayedFloat8Linear),
    and tell the modules that have a `use_float8()` to use it; the names of those converted and of those that
    took it (True back)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    converted = []
    for name, module in model.named_modules():
        if callable(getattr(module, "use_float8", None)):
            if module.use_float8():
                converted.append(name)
            continue
        if type(module) is not nn.Linear or uses[id(module.weight)] > 1:
            continue
        if getattr(module, "float8", True) is False:  # the model measured it slower in float8
            continue
        if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            continue
        module.__class__ = DelayedFloat8Linear if delayed else Float8Linear
        if isinstance(module, DelayedFloat8Linear):
            module.take_delayed_scaling()
        converted.append(name)
    if not converted:
        raise ValueError(
            "precision=fp8: the model has no nn.Linear that float8 can run (untied, not marked float8=False, "
            f"in and out features multiples of {FLOAT8_MULTIPLE}); use precision=bf16"
        )
    return converted
