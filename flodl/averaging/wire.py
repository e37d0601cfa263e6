"""What a local-SGD round puts on the wire for one flat float32 tensor: the `Wire` the assembly chooses once
(`wire_for`, from the config's `bf16_wire` and `quantized_wire`) and hands to the averager and the plan.

- `FP32`: the parameters themselves, summed by a weighted all-reduce (see `reducer.py`); no reference.
- `BF16`: the rank's weighted change since the shared reference, `bf16(w (θ - ref))`.
- `INT8` / `INT4`: the change plus the rank's error feedback (what rounding left out of its earlier rounds),
  in blocks of `BLOCK` elements, each as integers in [-127, 127] (one byte each) or [-7, 7] (two to a byte)
  with one float32 scale `max |x| / 127` (or `/ 7`); the rank's weight rides in the scales. Per element
  the rounding error is at most half a block's scale, and since each round sends what the previous ones left
  out, the rounding does not accumulate across rounds: the sum of what a rank sent differs from the sum of
  its changes by at most its last round's rounding.

A delta wire's payload is all-gathered and summed in float32 on every rank (`Deltas.sum_gathered`), so the
consensus `ref + Σ_k payload_k` is the same on every rank, bit for bit. Under sync the wire is DDP's
gradient buckets instead (`Wire.gradient_hook`: bf16 buckets, all-reduced; the quantized wires are refused
there by the rules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from flodl.averaging.ddp_hooks import bf16_gradient_hook

# Elements per block: one float32 scale per 512 values (int8: 3.97x fewer bytes than fp32, int4: 7.88x).
BLOCK = 512


class Deltas(Protocol):
    """A delta wire's encoder for one flat tensor, round after round (a quantized one keeps the rank's error
    feedback: float32, the tensor's size, on its device; part of the rank's state, saved with its
    checkpoint part)."""

    feedback: Tensor | None

    def encode(self, change: Tensor, weight: float) -> Tensor:
        """The payload for `weight * change` (1-D). A rank with no weight sends zeros (and keeps its
        feedback for a later round)."""
        ...

    def sum_gathered(self, gathered: Tensor, numel: int) -> Tensor:
        """Σ over ranks of the decoded payloads, in float32; `gathered` is `(world, payload)`."""
        ...

    def load_state(self, feedback: Tensor | None, like: Tensor) -> None:
        """Take a checkpoint's feedback, onto `like`'s device (the tensor it belongs to)."""
        ...

    def own_state(self, like: Tensor) -> list[Tensor]:
        """The feedback, zero until a round adds to it (none for a wire that keeps none): what a cut round
        gives back."""
        ...


@dataclass(frozen=True)
class Wire:
    """The float32 wire: the parameters themselves cross it, all-reduced; each rank sends 4 bytes an
    element and needs no reference."""

    name: str = "fp32"
    # A delta wire: what a rank sends is its change since the shared reference (the last consensus, or an
    # outer optimizer's global parameters), gathered and summed in float32.
    needs_reference: ClassVar[bool] = False
    # The config key that asks for this wire, as the plan names it, and as a Hydra override ("": the
    # default, asked by neither).
    key: ClassVar[str] = ""
    override: ClassVar[str] = ""
    # Under sync: the dtype gradient buckets cross the wire as (None: their own).
    bucket_dtype: ClassVar[torch.dtype | None] = None

    def payload_bytes(self, numel: int) -> int:
        """What a rank sends for one float32 tensor of `numel` elements."""
        return 4 * numel

    def deltas(self) -> Deltas:
        """A fresh encoder for one tensor (delta wires only)."""
        raise TypeError(f"the {self.name} wire sends no deltas")

    @property
    def gradient_hook(self) -> Callable[..., Any] | None:
        """Under sync: the DDP communication hook its gradient buckets cross the wire with (None: DDP's)."""
        return None

    def gradient_bytes(self, params: Sequence[Tensor]) -> int:
        """Under sync: what DDP all-reduces per optimizer step, every gradient as its hook sends it."""
        return sum(p.numel() * p.element_size() for p in params)


@dataclass(frozen=True)
class Bf16Wire(Wire):
    """The rank's weighted change as bf16: half the bytes of float32."""

    name: str = "bf16"
    needs_reference: ClassVar[bool] = True
    key: ClassVar[str] = "bf16_wire"
    override: ClassVar[str] = "bf16_wire=true"
    bucket_dtype: ClassVar[torch.dtype | None] = torch.bfloat16

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def deltas(self) -> Deltas:
        return Bf16Deltas()

    @property
    def gradient_hook(self) -> Callable[..., Any] | None:
        return bf16_gradient_hook

    def gradient_bytes(self, params: Sequence[Tensor]) -> int:
        return sum(2 * p.numel() for p in params)


@dataclass(frozen=True)
class QuantizedWire(Wire):
    """The change plus the error feedback as integer blocks in [-levels, levels], `per_byte` values to a
    byte, each block with one float32 scale; asked for by `quantized_wire=<name>`."""

    levels: int = 127
    per_byte: int = 1
    needs_reference: ClassVar[bool] = True

    @property
    def key(self) -> str:  # type: ignore[override]
        return f"quantized_wire={self.name}"

    @property
    def override(self) -> str:  # type: ignore[override]
        return self.key

    def payload_bytes(self, numel: int) -> int:
        return -(-numel // BLOCK) * (self.value_bytes(BLOCK) + 4)  # the padded blocks and their scales

    def value_bytes(self, block: int) -> int:
        """One block's values on the wire (without its scale)."""
        return block // self.per_byte

    def deltas(self) -> Deltas:
        return QuantizedDeltas(self)


FP32 = Wire()
BF16 = Bf16Wire()
INT8 = QuantizedWire("int8", levels=127, per_byte=1)
INT4 = QuantizedWire("int4", levels=7, per_byte=2)
# Every wire by name; the quantized ones' names are the config's allowed `quantized_wire` values
# (schema.QUANTIZED_WIRES, checked equal by the tests).
WIRES: dict[str, Wire] = {w.name: w for w in (FP32, BF16, INT8, INT4)}


def wire_for(bf16: bool, quantized: str | None) -> Wire:
    """The config's `bf16_wire` and `quantized_wire` as one wire: the only place they are read as one (both
    at once is refused before any rank starts)."""
    if quantized:
        return WIRES[quantized]
    return BF16 if bf16 else FP32


def quantize_blocks(x: Tensor, levels: int = INT8.levels, block: int = BLOCK) -> tuple[Tensor, Tensor]:
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


class Bf16Deltas:
    """The bf16 wire's encoder: nothing to remember between rounds."""

    feedback: Tensor | None = None

    def encode(self, change: Tensor, weight: float) -> Tensor:
        return (change * weight).to(torch.bfloat16)

    def sum_gathered(self, gathered: Tensor, numel: int) -> Tensor:
        return gathered.float().sum(dim=0)

    def load_state(self, feedback: Tensor | None, like: Tensor) -> None:
        assert feedback is None, "the bf16 wire keeps no feedback"

    def own_state(self, like: Tensor) -> list[Tensor]:
        return []


class QuantizedDeltas:
    """A quantized wire's encoder: the payload is the integer blocks (int4: packed) then their float32
    scales, as one uint8 buffer."""

    def __init__(self, wire: QuantizedWire, block: int = BLOCK) -> None:
        self.wire = wire
        self.block = block
        self.feedback: Tensor | None = None

    def encode(self, change: Tensor, weight: float) -> Tensor:
        if self.feedback is None:
            self.feedback = torch.zeros_like(change)
        levels = self.wire.levels
        if weight == 0.0:  # its window may be non-finite (zeroed): nothing of it enters the feedback
            q, scales = quantize_blocks(torch.zeros_like(change), levels, self.block)
        else:
            intended = change + self.feedback
            q, scales = quantize_blocks(intended, levels, self.block)
            torch.sub(intended, dequantize_blocks(q, scales, change.numel()), out=self.feedback)
        values = pack_int4(q) if self.wire.per_byte == 2 else q.view(torch.uint8)
        return torch.cat([values.reshape(-1), (scales * weight).view(torch.uint8)])

    def sum_gathered(self, gathered: Tensor, numel: int) -> Tensor:
        blocks = -(-numel // self.block)
        value_bytes = blocks * self.wire.value_bytes(self.block)
        scales = gathered[:, value_bytes:].contiguous().view(torch.float32)
        total = torch.zeros(blocks, self.block, dtype=torch.float32, device=gathered.device)
        for values, s in zip(gathered[:, :value_bytes], scales, strict=True):  # one rank at a time
            rows = values.view(blocks, -1)
            q = unpack_int4(rows) if self.wire.per_byte == 2 else rows.view(torch.int8)
            total.addcmul_(q.float(), s.unsqueeze(1))
        return total.view(-1)[:numel]

    def load_state(self, feedback: Tensor | None, like: Tensor) -> None:
        self.feedback = None if feedback is None else torch.empty_like(like).copy_(feedback)

    def own_state(self, like: Tensor) -> list[Tensor]:
        if self.feedback is None:
            self.feedback = torch.zeros_like(like)
        return [self.feedback]
