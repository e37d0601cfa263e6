"""What a local-SGD round puts on the wire for one flat float32 tensor.

- `fp32`: the parameters themselves, summed by an all-reduce (see `reducer.py`).
- `bf16`: the rank's weighted change since the shared reference, `bf16(w (θ - ref))`.
- `int8`: the change plus the rank's error feedback (what rounding left out of its earlier rounds), in
  blocks of `BLOCK` elements, each as int8 with one float32 scale `max |x| / 127`; the rank's weight
  rides in the scales. Per element the rounding error is at most half a block's scale, and since each
  round sends what the previous ones left out, the rounding does not accumulate across rounds: the sum of
  what a rank sent differs from the sum of its changes by at most its last round's rounding.

A delta payload is all-gathered and summed in float32 on every rank (`Deltas.sum_gathered`), so the
consensus `ref + Σ_k payload_k` is the same on every rank, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

WIRES = ("fp32", "bf16", "int8")
# Elements per int8 block: one float32 scale per 512 bytes of payload (3.97x fewer bytes than fp32).
BLOCK = 512
INT8_MAX = 127


def wire_of(bf16_wire: bool, int8_wire: bool) -> str:
    """The config's two switches as one wire (both at once is refused before any rank starts)."""
    return "int8" if int8_wire else "bf16" if bf16_wire else "fp32"


def payload_bytes(wire: str, numel: int) -> int:
    """What a rank sends for one float32 tensor of `numel` elements under `wire`."""
    if wire == "int8":
        return -(-numel // BLOCK) * (BLOCK + 4)  # the padded blocks and their scales
    return numel * (2 if wire == "bf16" else 4)


def quantize_blocks(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """A 1-D float32 tensor as int8 blocks `(blocks, block)` (the tail padded with zeros) and one scale per
    block, `max |x| / 127`: `x ≈ q * scale`, off by at most `scale / 2` per element."""
    blocks = -(-x.numel() // block)
    padded = F.pad(x, (0, blocks * block - x.numel())).view(blocks, block)
    scales = padded.abs().amax(dim=1) / INT8_MAX
    # An all-zero block has scale 0: divided by the smallest normal float instead, it stays zero.
    divisor = scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = (padded / divisor).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_blocks(q: Tensor, scales: Tensor, numel: int) -> Tensor:
    """`quantize_blocks`' inverse up to its rounding: the first `numel` elements of `q * scale`."""
    return (q.float() * scales.unsqueeze(1)).view(-1)[:numel]


class Deltas:
    """Encodes a rank's weighted change of one flat tensor per round, and sums the ranks' payloads.

    Under int8 it keeps the rank's error feedback (float32, the tensor's size, on its device): part of the
    rank's state, saved with its checkpoint part.
    """

    def __init__(self, wire: str, block: int = BLOCK) -> None:
        assert wire in ("bf16", "int8"), wire
        self.wire = wire
        self.block = block
        self.feedback: Tensor | None = None

    def encode(self, change: Tensor, weight: float) -> Tensor:
        """The payload for `weight * change` (1-D): bf16 values, or int8 blocks then their float32 scales
        as one uint8 buffer. A rank with no weight sends zeros and keeps its feedback for a later round."""
        if self.wire == "bf16":
            return (change * weight).to(torch.bfloat16)
        if self.feedback is None:
            self.feedback = torch.zeros_like(change)
        if weight == 0.0:  # its window may be non-finite (zeroed): nothing of it enters the feedback
            q, scales = quantize_blocks(torch.zeros_like(change), self.block)
        else:
            intended = change + self.feedback
            q, scales = quantize_blocks(intended, self.block)
            torch.sub(intended, dequantize_blocks(q, scales, change.numel()), out=self.feedback)
        return torch.cat([q.view(-1).view(torch.uint8), (scales * weight).view(torch.uint8)])

    def sum_gathered(self, gathered: Tensor, numel: int) -> Tensor:
        """Σ over ranks of the decoded payloads, in float32; `gathered` is `(world, payload)`."""
        if self.wire == "bf16":
            return gathered.float().sum(dim=0)
        blocks = -(-numel // self.block)
        quantized = gathered[:, : blocks * self.block].view(torch.int8)
        scales = gathered[:, blocks * self.block :].contiguous().view(torch.float32)
        total = torch.zeros(blocks, self.block, dtype=torch.float32, device=gathered.device)
        for q, s in zip(quantized, scales, strict=True):  # one rank at a time: no (world, numel) float copy
            total.addcmul_(q.view(blocks, self.block).float(), s.unsqueeze(1))
        return total.view(-1)[:numel]

    def state(self) -> Tensor | None:
        return self.feedback

    def load_state(self, feedback: Tensor | None, like: Tensor) -> None:
        """Take a checkpoint's feedback, onto `like`'s device (the tensor it belongs to)."""
        self.feedback = None if feedback is None else torch.empty_like(like).copy_(feedback)
