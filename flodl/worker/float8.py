"""precision=fp8: the model's linear layers multiply in float8 (torch._scaled_mm), scaled per tensor.

Each matmul of a converted nn.Linear casts its operands to float8 (inputs and weights e4m3, gradients e5m2,
as float8 training recipes do) and accumulates in higher precision; the output and gradients come back in
the input's dtype (bf16 under autocast). The weight, small, is scaled by its own absolute maximum. The input
and the gradient are scaled by the maxima the layer saw the step before (delayed scaling): the cast and the
new maximum then run in the kernel that produces them (a layer norm, a GELU, their backward passes, fused
by torch.compile), where taking the current maximum first would cost a pass of its own. On GPT-2-124M's
model this measured 1.12x bf16, per-tensor current scaling 0.97x (one H200,
bench/results/2026-12-05-float8-scaling-1x-NVIDIA-H200.md).

The maxima are 0-dim float32 buffers, outside the model's state_dict (model.pt loads into the plain model):
each rank keeps its own (they are no model state: not averaged, not broadcast by DDP), and a checkpoint
keeps them in the rank's part (`scaling_state`), so a resumed run casts as the uninterrupted one would. A
run's first step casts with a guess. A layer called more than once in a step (shared across depth) keeps
the maxima of its first call, whose backward pass runs last; the 2x headroom covers calls that differ less.

The conversion swaps a module's class and nothing else: its weight and bias stay the same Parameter objects,
read at every call, so the flat buffers (flodl/averaging/flat.py), the optimizer, DDP and captured CUDA
graphs keep pointing at what trains. Layers whose weight another module shares (a tied output layer), those
whose sizes float8 matmuls cannot take (multiples of 16) and those a model marked `float8 = False`
(flodl/tasks/gpt.py's `float8_blocks`) stay as they are. A module with a `use_float8()` method is told to
run its own matmuls in float8 (the GPT's tied output layer, inside its chunked loss).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

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


# What the previous step's absolute maximum is multiplied by for this step's scale, so that values may grow
# this much in one step before they saturate.
_HEADROOM = 2.0
# The first step's absolute maxima, before any was seen: inputs (layer norm and GELU outputs are a few units)
# and gradients (far below 1). Too high costs low values precision for that step, too low saturates it.
_FIRST_SEEN = {E4M3: 64.0, E5M2: 1.0}
# A Float8Linear's buffers of the maxima seen, in the order `scaling_state` keeps them.
SEEN = (("float8_seen_input", E4M3), ("float8_seen_grad", E5M2))


def _to_float8_as_seen(t: Tensor, seen: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`t` cast with the scale of the absolute maximum `seen` before; the inverse scale, and `t`'s own
    absolute maximum (for the next step). The maximum is taken per row first: that reduction runs in the
    cast's pass (and its producer's: a layer norm, a GELU), leaving one small reduction over the rows."""
    cast, inverse = _cast(t, torch.finfo(dtype).max / (seen * _HEADROOM), dtype)
    return cast, inverse, t.detach().abs().amax(dim=-1).max().float().clamp(min=1e-12)


class _Float8Matmul(torch.autograd.Function):
    """x (rows, in) @ weight (out, in).T in float8, both passes; the input and the gradient scaled by the
    maxima their module saw the step before (`seen_input`, `seen_grad`: 0-dim buffers). Both are written in
    the backward pass, after every read of them, so eval and the FLOP count (no backward) leave them as they
    were. Compiled, an earlier form read updates too soon: one element of a shared buffer (gradients 100x
    off), and the input's maximum written in the forward pass, whose inverse scale the min-cut partitioner
    recomputed in the backward pass from the written buffer (weight gradients 20-36x off).

    The forward pass also writes the input's maximum, to `latest_input`, which nothing reads: compiled, the
    write keeps that reduction in the forward pass, in the kernel that makes the input (a layer norm, a
    GELU). Without it inductor's partitioner moved the reduction into the backward pass and recomputed the
    input for it there: gpt2_124m's fp8 step was 4% slower (one H100, 521.9 against 544.4 samples/s)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, seen_input: Tensor, seen_grad: Tensor, latest_input: Tensor
    ) -> Tensor:
        x8, x_inv, x_amax = _to_float8_as_seen(x, seen_input, E4M3)
        latest_input.copy_(x_amax)
        w8, w_inv = _to_float8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv, x_amax, seen_input, seen_grad)
        ctx.weight_dtype = weight.dtype
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x8, x_inv, w8, w_inv, x_amax, seen_input, seen_grad = ctx.saved_tensors  # before the writes below
        g8, g_inv, g_amax = _to_float8_as_seen(grad, seen_grad, E5M2)
        grad_x = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32
        )
        seen_input.copy_(x_amax)
        seen_grad.copy_(g_amax)
        return grad_x, grad_w.to(ctx.weight_dtype), None, None, None


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmul runs in float8 (made by `convert_to_float8`, never built directly)."""

    float8_seen_input: Tensor
    float8_seen_grad: Tensor
    float8_latest_input: Tensor

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            rows = x.reshape(-1, self.in_features).to(dtype)
            out = _Float8Matmul.apply(
                rows, self.weight, self.float8_seen_input, self.float8_seen_grad, self.float8_latest_input
            )
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out.view(*x.shape[:-1], self.out_features)


def scaling_state(model: nn.Module) -> dict[str, Tensor]:
    """Each float8 layer's maxima seen (input, gradient), by the layer's name: what a rank's checkpoint part
    keeps (copies: the layers go on updating theirs)."""
    return {
        name: torch.stack([getattr(module, seen) for seen, _ in SEEN])
        for name, module in model.named_modules()
        if isinstance(module, Float8Linear)
    }


def restore_scaling(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Put back the maxima `scaling_state` kept, in place (captured CUDA graphs read these buffers). Layers
    the state has none for (a checkpoint of another precision, or older than the maxima) keep the first
    step's guess, as a new run's do; both are said."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    with torch.no_grad():
        for name in layers.keys() & state.keys():
            for index, (seen, _) in enumerate(SEEN):
                getattr(layers[name], seen).copy_(state[name][index])
    if missing := sorted(layers.keys() - state.keys()):
        log.info(
            "float8: the checkpoint has no maxima for %d layers (%s, ...): their first step guesses",
            len(missing),
            missing[0],
        )
    if unknown := sorted(state.keys() - layers.keys()):
        log.info(
            "float8: the checkpoint's maxima of %d layers not in float8 here (%s, ...) are not used",
            len(unknown),
            unknown[0],
        )


def convert_to_float8(model: nn.Module) -> list[str]:
    """Turn `model`'s eligible nn.Linear modules into Float8Linear in place, and tell the modules that have a
    `use_float8()` to use it; the names of those converted and of those that took it (True back)."""
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
        module.__class__ = Float8Linear
        for seen, dtype in SEEN:  # not saved with the model: `scaling_state`
            first = torch.tensor(_FIRST_SEEN[dtype], device=module.weight.device)
            module.register_buffer(seen, first, persistent=False)
        latest = torch.zeros((), device=module.weight.device)
        module.register_buffer("float8_latest_input", latest, persistent=False)
        converted.append(name)
    if not converted:
        raise ValueError(
            "precision=fp8: the model has no nn.Linear that float8 can run (untied, not marked float8=False, "
            f"in and out features multiples of {FLOAT8_MULTIPLE}); use precision=bf16"
        )
    return converted
