"""Cross-entropy through a linear output layer, in chunks of tokens: the full float32 logits never exist.

Over a 50k vocabulary the logits of a 16 x 1024 batch are 3.3 GB in float32, and their gradient as much
again. Here each chunk's logits are made, turned into its loss and its gradient (softmax - one-hot) at once,
and dropped: the forward pass already holds the gradients of the hidden states and of the weight, and the
backward pass only scales them. The matmuls run in the hidden states' dtype (bf16 under autocast), the
softmax in float32. Static shapes and no value read back: nothing waits on the device.

Under torch.compile the softmax's gradient is written as one expression (the one-hot a comparison with the
vocabulary's ids), which the compiler fuses into one pass over the chunk's logits; eager, it is made in
place in the logits' own memory. `float8`: the logits and the hidden states' gradient multiply in float8
(torch._scaled_mm: the hidden states and the weight e4m3, scaled per tensor; the softmax gradient, whose
values lie in [-1, 1], e5m2 at a fixed scale); the weight's gradient stays in the hidden states' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# softmax - one-hot lies in [-1, 1]: scaled by this power of two it spans e5m2's range below its max (57344).
_GRAD_SCALE = 2.0**15


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, float8: bool
    ) -> Tensor:
        rows = hidden.shape[0]
        # The matmuls' dtype: autocast's (layer norms under autocast hand over float32 hidden states), else
        # the hidden states' own; the softmax gradient is made in it, so no float32 copy of it is cast again.
        device = hidden.device.type
        work = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        head = _Float8Head(weight, work) if float8 else _Head(weight, work)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            h = hidden[start : start + chunk].to(work)
            picked = targets[start : start + chunk]
            loss, grad = _loss_and_grad(head.logits(h), picked, work)
            total = total + loss
            grad_h, grad_w = head.grads(h, grad)
            grad_hidden[start : start + chunk] = grad_h
            grad_weight += grad_w.float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.rows = rows
        ctx.weight_dtype = weight.dtype
        return total / rows

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_out / ctx.rows
        return (
            grad_hidden * scale.to(grad_hidden.dtype),
            (grad_weight * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def _loss_and_grad(logits: Tensor, targets: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The chunk's summed cross-entropy (float32) and d(sum)/d logits = softmax - one-hot, in `dtype`."""
    wide = logits.float()
    norm = torch.logsumexp(wide, dim=-1, keepdim=True)
    loss = (norm - wide.gather(1, targets[:, None])).sum()
    if torch.compiler.is_compiling():  # one expression: one fused pass over the logits
        ids = torch.arange(wide.shape[1], device=wide.device)
        one_hot = (ids[None, :] == targets[:, None]).to(wide.dtype)
        return loss, ((wide - norm).exp() - one_hot).to(dtype)
    grad = wide.sub_(norm).exp_()  # in place: the chunk's logits are this function's own
    grad.scatter_add_(1, targets[:, None], grad.new_full((targets.shape[0], 1), -1.0))
    return loss, grad.to(dtype)


class _Head:
    """The output layer's matmuls of a chunk, in the work dtype: its logits, and from their softmax gradient
    the gradients of the hidden states and of the weight."""

    def __init__(self, weight: Tensor, work: torch.dtype) -> None:
        self.weight = weight.to(work)

    def logits(self, h: Tensor) -> Tensor:
        return h @ self.weight.t()

    def grads(self, h: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad @ self.weight, grad.t() @ h


class _Float8Head:
    """As `_Head`, the logits and the hidden states' gradient in float8 (the weight's gradient stays in the
    work dtype); the weight cast once per forward, both layouts (torch._scaled_mm multiplies a row-major
    operand by a column-major one)."""

    def __init__(self, weight: Tensor, out_dtype: torch.dtype) -> None:
        self.out_dtype = out_dtype
        self.weight8, self.weight_inv = _to_float8(weight, E4M3)
        self.weight8_t = self.weight8.t().contiguous()
        self.grad_inv = torch.full((), 1.0 / _GRAD_SCALE, dtype=torch.float32, device=weight.device)

    def logits(self, h: Tensor) -> Tensor:
        h8, h_inv = _to_float8(h, E4M3)
        return torch._scaled_mm(
            h8, self.weight8.t(), scale_a=h_inv, scale_b=self.weight_inv, out_dtype=self.out_dtype
        )

    def grads(self, h: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        """The chunk's gradients of the hidden states (float8) and of the weight (in `h`'s dtype), from its
        softmax gradient `grad`."""
        return self.grad_hidden(self.cast_grad(grad)), grad.t() @ h

    def cast_grad(self, grad: Tensor) -> Tensor:
        return (grad.float() * _GRAD_SCALE).to(E5M2)

    def grad_hidden(self, g8: Tensor) -> Tensor:
        return torch._scaled_mm(
            g8, self.weight8_t.t(), scale_a=self.grad_inv, scale_b=self.weight_inv, out_dtype=self.out_dtype
        )


def _to_float8(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`t` scaled so that its absolute maximum is float8's, cast; and the scale that undoes it (float32)."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = top / amax
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 4096, float8: bool = False
) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` (rows, vocab) against `targets` (rows,), `chunk` rows of
    logits at a time. `hidden` (rows, dim), `weight` (vocab, dim): the output layer's (a tied embedding's).
    `float8`: the training pass's logits and hidden-state gradient multiply in float8 (a CUDA GPU with
    float8 matmuls; eval's loss stays in the hidden states' dtype)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: expected hidden (rows, dim) and targets (rows,), got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be >= 1, got {chunk}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, float8)
    return _loss_only(hidden, weight, targets, chunk)  # eval: no gradient to make ahead


def _loss_only(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    low = weight.to(hidden.dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start : start + chunk] @ low.t()).float()
        picked = targets[start : start + chunk, None]
        total = total + (torch.logsumexp(logits, dim=-1, keepdim=True) - logits.gather(1, picked)).sum()
    return total / hidden.shape[0]
