"""Cross-entropy through a linear output layer, in chunks of tokens: the full float32 logits never exist.

Over a 50k vocabulary the logits of a 16 x 1024 batch are 3.3 GB in float32, and their gradient as much
again. Here each chunk's logits are made, turned into its loss and its gradient (softmax - one-hot) at once,
and dropped: the forward pass already holds the gradients of the hidden states and of the weight, and the
backward pass only scales them. The matmuls run in the hidden states' dtype (bf16 under autocast), the
softmax in float32. Static shapes and no value read back: nothing waits on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        rows = hidden.shape[0]
        low = weight.to(hidden.dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            h = hidden[start : start + chunk]
            picked = targets[start : start + chunk, None]
            logits = (h @ low.t()).float()
            norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            total = total + (norm - logits.gather(1, picked)).sum()
            # d(sum of losses)/d logits = softmax - one-hot, made in the logits' own memory; the mean's
            # 1/rows is applied in backward.
            grad = logits.sub_(norm).exp_()
            grad.scatter_add_(1, picked, grad.new_full(picked.shape, -1.0))
            grad = grad.to(hidden.dtype)
            grad_hidden[start : start + chunk] = grad @ low
            grad_weight += (grad.t() @ h).float()
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
        )


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 4096) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` (rows, vocab) against `targets` (rows,), `chunk` rows of
    logits at a time. `hidden` (rows, dim), `weight` (vocab, dim): the output layer's (a tied embedding's)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_cross_entropy: expected hidden (rows, dim) and targets (rows,), got "
            f"{tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be >= 1, got {chunk}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk)
    return _loss_only(hidden, weight, targets, chunk)  # eval: no gradient to make ahead


def _loss_only(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    low = weight.to(hidden.dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start : start + chunk] @ low.t()).float()
        picked = targets[start : start + chunk, None]
        total = total + (torch.logsumexp(logits, dim=-1, keepdim=True) - logits.gather(1, picked)).sum()
    return total / hidden.shape[0]
