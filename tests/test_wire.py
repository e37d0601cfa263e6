"""The local-SGD wire's encodings on one rank (flodl/averaging/wire.py); over gloo ranks in
tests/test_consensus_collective.py."""

from __future__ import annotations

import pytest
import torch

from flodl.averaging.wire import (
    BLOCK,
    LEVELS,
    Deltas,
    dequantize_blocks,
    pack_int4,
    payload_bytes,
    quantize_blocks,
    unpack_int4,
    wire_of,
)
from flodl.config.schema import QUANTIZED_WIRES


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_blocks_round_to_half_a_scale_and_pad_the_tail(wire: str) -> None:
    levels = LEVELS[wire]
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


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_error_feedback_keeps_the_rounding_from_accumulating(wire: str) -> None:
    """What a rank sent over many rounds differs from the sum of its changes by its last rounding only;
    without the feedback the roundings would add up."""
    gen = torch.Generator().manual_seed(1)
    deltas = Deltas(wire)
    drift = torch.randn(3000, generator=gen) * 0.01  # a consistent pull, which plain rounding biases
    sent_sum, change_sum, plain_sum = torch.zeros(3000), torch.zeros(3000), torch.zeros(3000)
    for _ in range(50):
        change = drift + torch.randn(3000, generator=gen)
        payload = deltas.encode(change, 1.0)
        sent_sum += deltas.sum_gathered(payload.unsqueeze(0), change.numel())
        q, scales = quantize_blocks(change, LEVELS[wire])
        plain_sum += dequantize_blocks(q, scales, change.numel())
        change_sum += change
        assert deltas.feedback is not None
        assert torch.allclose(change_sum - sent_sum, deltas.feedback, atol=1e-4)
    last_scale = float(deltas.feedback.abs().max())
    assert float((change_sum - sent_sum).abs().max()) <= last_scale + 1e-4
    assert float((change_sum - plain_sum).abs().max()) > 3 * last_scale


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_a_rank_without_weight_sends_zeros_and_keeps_its_feedback(wire: str) -> None:
    deltas = Deltas(wire)
    deltas.encode(torch.randn(100), 1.0)
    kept = deltas.feedback.clone()  # type: ignore[union-attr]
    payload = deltas.encode(torch.full((100,), float("nan")), 0.0)  # a zeroed, non-finite window
    assert float(deltas.sum_gathered(payload.unsqueeze(0), 100).abs().max()) == 0.0
    assert torch.equal(deltas.feedback, kept)  # type: ignore[arg-type]


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4"])
def test_payloads_sum_to_the_weighted_changes_and_count_their_bytes(wire: str) -> None:
    gen = torch.Generator().manual_seed(2)
    changes = [torch.randn(1500, generator=gen) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    encoders = [Deltas(wire) for _ in changes]
    payloads = [e.encode(c, w) for e, c, w in zip(encoders, changes, weights, strict=True)]
    assert all(p.numel() * p.element_size() == payload_bytes(wire, 1500) for p in payloads)
    total = encoders[0].sum_gathered(torch.stack(payloads), 1500)
    exact = sum(w * c for w, c in zip(weights, changes, strict=True))
    step = max(float(c.abs().max()) for c in changes) / LEVELS.get(wire, 256)
    assert float((total - exact).abs().max()) <= step  # Σ w = 1: at most one rounding step in all


def test_the_wires_bytes_and_names() -> None:
    assert payload_bytes("fp32", 1000) == 4000 and payload_bytes("bf16", 1000) == 2000
    assert payload_bytes("int8", 1000) == 2 * (BLOCK + 4)  # two blocks, the second padded
    assert payload_bytes("int4", 1000) == 2 * (BLOCK // 2 + 4)
    assert [wire_of(False, None), wire_of(True, None), wire_of(False, "int4")] == ["fp32", "bf16", "int4"]


def test_the_configs_quantized_wires_are_the_codecs() -> None:
    assert set(QUANTIZED_WIRES) == set(LEVELS)  # a value the rules allow always has its codec


def test_feedback_loads_onto_its_tensors_device() -> None:
    deltas = Deltas("int8")
    like = torch.zeros(10, dtype=torch.float32)
    deltas.load_state(torch.arange(10.0), like)
    assert deltas.feedback is not None and torch.equal(deltas.feedback, torch.arange(10.0))
