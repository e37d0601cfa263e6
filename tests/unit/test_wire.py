"""The local-SGD wire on one rank (flodl/averaging/wire.py): the `Wire` objects the assembly chooses once,
their encodings, byte counts and references; over gloo ranks in tests/runs/test_consensus_collective.py."""

from __future__ import annotations

import pytest
import torch

from flodl.averaging.ddp_hooks import bf16_gradient_hook
from flodl.averaging.wire import (
    BF16,
    BLOCK,
    FP32,
    INT4,
    INT8,
    WIRES,
    QuantizedWire,
    Wire,
    dequantize_blocks,
    pack_int4,
    quantize_blocks,
    unpack_int4,
    wire_for,
)
from flodl.config.schema import QUANTIZED_WIRES

QUANTIZED = [INT8, INT4]
DELTA_WIRES = [BF16, INT8, INT4]


def named(wire: Wire) -> str:
    return wire.name


@pytest.mark.parametrize("wire", QUANTIZED, ids=named)
def test_blocks_round_to_half_a_scale_and_pad_the_tail(wire: QuantizedWire) -> None:
    levels = wire.levels
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BLOCK + 7, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(
        torch.tensor([BLOCK, BLOCK, 7])
    )  # blocks of very different magnitude: each keeps its own scale
    q, scales = quantize_blocks(x, levels)
    assert q.dtype == torch.int8 and q.shape == (3, BLOCK) and scales.shape == (3,)
    assert int(q.abs().max()) == levels
    back = dequantize_blocks(q, scales, x.numel())
    for b in range(3):
        span = slice(b * BLOCK, min((b + 1) * BLOCK, x.numel()))
        assert float(scales[b]) == pytest.approx(float(x[span].abs().max()) / levels)
        assert float((back[span] - x[span]).abs().max()) <= float(scales[b]) / 2 * (1 + 1e-6)
    assert bool((q[2, 7:] == 0).all())  # the padding


def test_an_all_zero_block_stays_zero() -> None:
    q, scales = quantize_blocks(torch.zeros(BLOCK + 1))
    assert bool((q == 0).all()) and bool((scales == 0).all())


def test_int4_packs_two_values_to_a_byte_and_back() -> None:
    q = torch.arange(-7, 8, dtype=torch.int8).repeat(2, 2)[:, :30]  # every value, odd and even positions
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 15)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("wire", QUANTIZED, ids=named)
def test_error_feedback_keeps_the_rounding_from_accumulating(wire: QuantizedWire) -> None:
    """What a rank sent over many rounds differs from the sum of its changes by its last rounding only;
    without the feedback the roundings would add up."""
    gen = torch.Generator().manual_seed(1)
    deltas = wire.deltas()
    drift = torch.randn(3000, generator=gen) * 0.01  # a consistent pull, which plain rounding biases
    sent_sum, change_sum, plain_sum = torch.zeros(3000), torch.zeros(3000), torch.zeros(3000)
    for _ in range(50):
        change = drift + torch.randn(3000, generator=gen)
        payload = deltas.encode(change, 1.0)
        sent_sum += deltas.sum_gathered(payload.unsqueeze(0), change.numel())
        q, scales = quantize_blocks(change, wire.levels)
        plain_sum += dequantize_blocks(q, scales, change.numel())
        change_sum += change
        assert deltas.feedback is not None
        assert torch.allclose(change_sum - sent_sum, deltas.feedback, atol=1e-4)
    assert deltas.feedback is not None
    last_scale = float(deltas.feedback.abs().max())
    assert float((change_sum - sent_sum).abs().max()) <= last_scale + 1e-4
    assert float((change_sum - plain_sum).abs().max()) > 3 * last_scale


@pytest.mark.parametrize("wire", QUANTIZED, ids=named)
def test_a_rank_without_weight_sends_zeros_and_keeps_its_feedback(wire: QuantizedWire) -> None:
    deltas = wire.deltas()
    deltas.encode(torch.randn(100), 1.0)
    assert deltas.feedback is not None
    kept = deltas.feedback.clone()
    payload = deltas.encode(torch.full((100,), float("nan")), 0.0)  # a zeroed, non-finite window
    assert float(deltas.sum_gathered(payload.unsqueeze(0), 100).abs().max()) == 0.0
    assert torch.equal(deltas.feedback, kept)


@pytest.mark.parametrize("wire", DELTA_WIRES, ids=named)
@pytest.mark.parametrize("numel", [1, BLOCK, 1500])
def test_payloads_sum_to_the_weighted_changes_within_a_rounding_step_and_count_their_bytes(
    wire: Wire, numel: int
) -> None:
    gen = torch.Generator().manual_seed(2)
    changes = [torch.randn(numel, generator=gen) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    encoders = [wire.deltas() for _ in changes]
    payloads = [e.encode(c, w) for e, c, w in zip(encoders, changes, weights, strict=True)]
    assert all(p.numel() * p.element_size() == wire.payload_bytes(numel) for p in payloads)
    total = encoders[0].sum_gathered(torch.stack(payloads), numel)
    exact = sum(w * c for w, c in zip(weights, changes, strict=True))
    # bf16 keeps 8 significant bits (half a step of 2^-8 per value); a quantized wire half a block's scale.
    levels = wire.levels if isinstance(wire, QuantizedWire) else 256
    step = max(float(c.abs().max()) for c in changes) / levels
    assert float((total - exact).abs().max()) <= step  # Σ w = 1: at most one rounding step in all


def test_each_wires_payload_bytes_follow_its_formula() -> None:
    for numel in (1, 1000, BLOCK, 3 * BLOCK + 1):
        blocks = -(-numel // BLOCK)  # the tail block is padded
        assert FP32.payload_bytes(numel) == 4 * numel
        assert BF16.payload_bytes(numel) == 2 * numel
        assert INT8.payload_bytes(numel) == blocks * (BLOCK + 4)  # a byte a value, a float32 scale a block
        assert INT4.payload_bytes(numel) == blocks * (BLOCK // 2 + 4)  # two values a byte


def test_only_the_delta_wires_need_a_reference_and_only_fp32_sends_no_deltas() -> None:
    assert [w.needs_reference for w in (FP32, BF16, INT8, INT4)] == [False, True, True, True]
    with pytest.raises(TypeError, match="fp32 wire sends no deltas"):
        FP32.deltas()
    assert BF16.deltas().feedback is None  # bf16 remembers nothing between rounds


def test_the_config_chooses_one_wire_and_names_its_key() -> None:
    assert wire_for(False, None) is FP32 and wire_for(True, None) is BF16
    assert wire_for(False, "int8") is INT8 and wire_for(False, "int4") is INT4
    assert [w.key for w in (BF16, INT8, INT4)] == ["bf16_wire", "quantized_wire=int8", "quantized_wire=int4"]
    # Under sync only bf16 changes DDP's buckets.
    assert BF16.gradient_hook is bf16_gradient_hook and FP32.gradient_hook is None


def test_the_configs_quantized_wires_are_the_codecs() -> None:
    # A value the rules allow always has its wire.
    assert {n for n, w in WIRES.items() if isinstance(w, QuantizedWire)} == set(QUANTIZED_WIRES)


def test_feedback_loads_onto_its_tensors_device() -> None:
    deltas = INT8.deltas()
    like = torch.zeros(10, dtype=torch.float32)
    deltas.load_state(torch.arange(10.0), like)
    assert deltas.feedback is not None and torch.equal(deltas.feedback, torch.arange(10.0))
