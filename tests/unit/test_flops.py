"""MFU's parts: a model's FLOPs per training sample (a task's own formula, or counted) and device peaks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl.metrics.flops import PEAK_BF16_TFLOPS, peak_flops, train_flops_per_sample
from flodl.metrics.scalars import drain_scalars, record_scalar
from flodl.tasks.classification import cross_entropy_loss
from flodl.tasks.gpt import GPT, next_token_loss


def test_a_counted_model_costs_three_forward_passes_and_counting_leaves_no_trace():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    batch = [torch.randn(4, 8), torch.tensor([0, 1, 0, 1])]
    stats = model[1].running_mean.clone()
    generator_state = torch.get_rng_state()
    drain_scalars()  # what earlier tests in this thread recorded
    record_scalar("mine", 1.0)

    def recording_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        record_scalar("mine", 5.0)
        return cross_entropy_loss(model, batch)

    flops = train_flops_per_sample(model, recording_loss, batch, 4)
    assert drain_scalars() == {"mine": [1.0, 1.0]}  # the loss's values from the count are left out
    # Forward matmuls: 2·8·16 + 2·16·2 per sample; the step is three times that.
    assert flops == 3 * (2 * 8 * 16 + 2 * 16 * 2)
    assert torch.equal(model[1].running_mean, stats) and model.training
    assert torch.equal(torch.get_rng_state(), generator_state)
    assert all(p.grad is None for p in model.parameters())


def test_a_gpt_declares_6n_plus_12_l_d_t_per_token_close_to_what_is_counted():
    model = GPT(layers=2, dim=64, heads=2, context=32, amp=False)
    inputs = torch.randint(0, 256, (3, 32))
    declared = train_flops_per_sample(model, next_token_loss, [inputs, inputs], 3)
    params = sum(p.numel() for p in model.parameters()) - model.positions.weight.numel()
    assert declared == (6 * params + 12 * 2 * 64 * 32) * 32
    # The formula leaves out the small ops (and counts the embedding lookup as a matmul): within 15%.
    counted = 3 * _forward_flops(model, inputs) / inputs.shape[0]
    assert counted == pytest.approx(declared, rel=0.15)


def _forward_flops(model: nn.Module, inputs: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(inputs)
    return counter.get_total_flops()


def test_peaks_come_from_the_table_by_device_name_or_the_override(monkeypatch: pytest.MonkeyPatch):
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), override_tflops=100.0) == 100e12
    names = {
        "NVIDIA H200": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA GeForce RTX 3090": None,
    }
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda", 0)) == peak, name
    # Every entry is reachable: none is shadowed by an earlier, shorter one it contains.
    for i, (name, _) in enumerate(PEAK_BF16_TFLOPS):
        assert not any(earlier in name for earlier, _ in PEAK_BF16_TFLOPS[:i]), name
