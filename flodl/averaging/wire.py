"""What a local-SGD round puts on the wire for one flat float32 tensor.

- `fp32`: the parameters themselves, summed by an all-reduce (see `reducer.py`).
- `bf16`: the rank's weighted change since the shared reference, `bf16(w (θ - ref))`.
- `int8` / `int4`: the change plus the rank's error feedback (what rounding left out of its earlier rounds),
  in blocks of `BLOCK` elements, each as integers in [-127, 127] (one byte each) or [-7, 7] (two to a byte)
  with one float32 scale `max |x| / 127` (or `/ 7`); the rank's weight rides in the scales. Per element
  the rounding error is at most half a block's scale, and since each round sends what the previous ones left
  out, the rounding does not accumulate across rounds: the sum of what a rank sent differs from the sum of
  its changes by at most its last round's rounding.

A delta payload is all-gathered and summed in float32 on every rank (`Deltas.sum_gathered`), so the
consensus `ref + Σ_k payload_k` is the same on every rank, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Elements per block: one float32 scale per 512 values (int8: 3.97x fewer bytes than fp32, int4: 7.88x).
BLOCK = 512
# The largest integer each quantized wire sends (symmetric, so zero is exact); the config's allowed values
# (schema.QUANTIZED_WIRES) are these keys.
LEVELS = {"int8": 127, "int4": 7}


def wire_of(bf16_wire: bool, quantized_wire: str | None) -> str:
    """The config's wire keys as one wire (both at once is refused before any rank starts)."""
    return quantized_wire or ("bf16" if bf16_wire else "fp32")


def payload_bytes(wire: str, numel: int) -> int:
    """What a rank sends for one float32 tensor of `numel` elements under `wire`."""
    blocks = -(-numel // BLOCK)
    if wire == "int8":
        return blocks * (BLOCK + 4)  # the padded blocks and their scales
    if wire == "int4":
        return blocks * (BLOCK // 2 + 4)
    return numel * (2 if wire == "bf16" else 4)


def quantize_blocks(x: Tensor, levels: int = LEVELS["int8"], block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """A 1-D float32 tensor as integer blocks `(blocks, block)` in [-levels, levels] (int8; the tail padded
    with zeros) and one scale per block, `max |x| / levels`: `x ≈ q * scale`, off by at most `scale / 2`."""
    blocks = -(-x.numel() // block)
    padded = F.pad(x, (0, blocks * block - x.numel())).view(blocks, block)
    scales = padded.abs().amax(dim=1) / levels
    # An all-zero block has scale 0: divided by the smallest normal float instead, it stays zero.
    divisor = scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    q = (padded / divisor).round_().clamp_(-levels, levels).to(torch.int8)
    return q, scales


def dequantize_blocks(q: Tensor, scales: Tensor, numel: int) -> Tensor:
    """`quantize_blocks`' inverse up to its rounding: the first `numel` elements of `q * scale`."""
    return (q.float() * scales.unsqueeze(1)).view(-1)[:numel]


def pack_int4(q: Tensor) -> Tensor:
    """Blocks of integers in [-7, 7] as bytes, two to a byte (even positions in the low nibble)."""
    shifted = (q + 8).to(torch.uint8)
    return shifted[:, 0::2] | (shifted[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """`pack_int4`'s inverse: `(blocks, block // 2)` bytes back to `(blocks, block)` int8."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=2).view(packed.shape[0], -1).to(torch.int8) - 8


class Deltas:
    """Encodes a rank's weighted change of one flat tensor per round, and sums the ranks' payloads.

    Quantized, it keeps the rank's error feedback (float32, the tensor's size, on its device): part of the
    rank's state, saved with its checkpoint part.
    """

    def __init__(self, wire: str, block: int = BLOCK) -> None:
        assert wire == "bf16" or wire in LEVELS, wire
        self.wire = wire
        self.block = block
        self.feedback: Tensor | None = None

    def encode(self, change: Tensor, weight: float) -> Tensor:
        """The payload for `weight * change` (1-D): bf16 values, or the integer blocks (int4: packed) then
        their float32 scales as one uint8 buffer. A rank with no weight sends zeros and keeps its feedback
        for a later round."""
        if self.wire == "bf16":
            return (change * weight).to(torch.bfloat16)
        if self.feedback is None:
            self.feedback = torch.zeros_like(change)
        levels = LEVELS[self.wire]
        if weight == 0.0:  # its window may be non-finite (zeroed): nothing of it enters the feedback
            q, scales = quantize_blocks(torch.zeros_like(change), levels, self.block)
        else:
            intended = change + self.feedback
            q, scales = quantize_blocks(intended, levels, self.block)
            torch.sub(intended, dequantize_blocks(q, scales, change.numel()), out=self.feedback)
        values = pack_int4(q) if self.wire == "int4" else q.view(torch.uint8)
        return torch.cat([values.reshape(-1), (scales * weight).view(torch.uint8)])

    def sum_gathered(self, gathered: Tensor, numel: int) -> Tensor:
        """Σ over ranks of the decoded payloads, in float32; `gathered` is `(world, payload)`."""
        if self.wire == "bf16":
            return gathered.float().sum(dim=0)
        blocks = -(-numel // self.block)
        value_bytes = blocks * self.block // (2 if self.wire == "int4" else 1)
        scales = gathered[:, value_bytes:].contiguous().view(torch.float32)
        total = torch.zeros(blocks, self.block, dtype=torch.float32, device=gathered.device)
        for values, s in zip(gathered[:, :value_bytes], scales, strict=True):  # one rank at a time
            rows = values.view(blocks, -1)
            q = unpack_int4(rows) if self.wire == "int4" else rows.view(torch.int8)
            total.addcmul_(q.float(), s.unsqueeze(1))
        return total.view(-1)[:numel]

    def load_state(self, feedback: Tensor | None, like: Tensor) -> None:
        """Take a checkpoint's feedback, onto `like`'s device (the tensor it belongs to)."""
        self.feedback = None if feedback is None else torch.empty_like(like).copy_(feedback)
