"""The divergence triple: ||pre - post|| / ||post||, pre and post norms, float64 accumulation, one sync."""

from __future__ import annotations

import math

import pytest
import torch

from flodl.averaging.divergence import divergence_triple


def flat(tensors):
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def hand_triple(pre, post):
    p, q = flat(pre), flat(post)
    post_norm = float(q.norm())
    return float((p - q).norm()) / post_norm, float(p.norm()), post_norm


def test_single_tensor_by_hand():
    d, pre_norm, post_norm = divergence_triple([torch.tensor([3.0, 4.0])], [torch.tensor([6.0, 8.0])])
    assert (d, pre_norm, post_norm) == pytest.approx((0.5, 5.0, 10.0), rel=1e-12)


def test_norms_are_global_over_all_tensors():
    pre = [torch.tensor([3.0, 4.0]), torch.tensor([[0.0, 12.0]])]  # ||pre|| = 13
    post = [torch.tensor([0.0, 0.0]), torch.tensor([[0.0, 5.0]])]  # ||post|| = 5, ||diff|| = sqrt(74)
    triple = divergence_triple(pre, post)
    assert triple.pre_norm == pytest.approx(13.0, rel=1e-12)
    assert triple.post_norm == pytest.approx(5.0, rel=1e-12)
    assert triple.divergence == pytest.approx(math.sqrt(74.0) / 5.0, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_random_models_match_a_float64_hand_computation(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (10, 64), (10,), (3, 3, 4, 4)]
    post = [torch.randn(s, generator=gen) for s in shapes]
    pre = [q + 0.01 * torch.randn(q.shape, generator=gen) for q in post]
    got = divergence_triple(pre, post)
    assert tuple(got) == pytest.approx(hand_triple(pre, post), rel=1e-6)


def test_identical_pre_and_post_diverge_by_zero():
    post = [torch.randn(5, 5), torch.randn(7)]
    pre = [t.clone() for t in post]
    d, pre_norm, post_norm = divergence_triple(pre, post)
    assert d == 0.0
    assert pre_norm == post_norm > 0


def test_zero_post_norm_gives_zero_divergence_not_nan():
    d, pre_norm, post_norm = divergence_triple([torch.ones(4)], [torch.zeros(4)])
    assert d == 0.0 and not math.isnan(d)
    assert post_norm == 0.0
    assert pre_norm == pytest.approx(2.0)


def test_accumulates_in_float64():
    # Squares of 1e20 overflow float32: a float32 accumulation would report inf.
    pre = [torch.full((4,), 1e20)]
    post = [torch.full((4,), 2e20)]
    d, pre_norm, post_norm = divergence_triple(pre, post)
    assert math.isfinite(pre_norm) and math.isfinite(post_norm)
    assert (d, pre_norm, post_norm) == pytest.approx((0.5, 2e20, 4e20), rel=1e-6)


def test_in_place_turns_pre_into_the_difference_and_default_leaves_it_alone():
    post = [torch.randn(6), torch.randn(2, 3)]
    pre = [q + 1.0 for q in post]
    kept = [t.clone() for t in pre]
    out_of_place = divergence_triple(pre, post)
    assert all(torch.equal(a, b) for a, b in zip(pre, kept, strict=True))
    in_place = divergence_triple(pre, post, in_place=True)
    assert tuple(in_place) == pytest.approx(tuple(out_of_place), rel=1e-12)
    for p, k, q in zip(pre, kept, post, strict=True):
        assert torch.equal(p, k - q)


def test_parameters_that_require_grad_work_in_place():
    pre = [torch.nn.Parameter(torch.ones(3))]
    triple = divergence_triple(pre, [torch.full((3,), 2.0)], in_place=True)
    assert triple.divergence == pytest.approx(0.5)


def test_bf16_consensus_against_float32_scratch():
    post32 = [torch.tensor([6.0, 8.0]), torch.tensor([2.0, 4.0])]  # bf16-exact values
    pre = [torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0])]
    ref = divergence_triple(pre, post32)
    mixed = divergence_triple(pre, [t.bfloat16() for t in post32])
    assert tuple(mixed) == pytest.approx(tuple(ref), rel=1e-12)


def test_one_host_read_for_the_whole_model(monkeypatch):
    reads = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.shape)
        return real_tolist(self)

    def no_item(self):
        raise AssertionError("per-tensor .item() host sync")

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    post = [torch.randn(4) for _ in range(20)]
    divergence_triple([q * 1.5 for q in post], post)
    assert len(reads) == 1


def test_empty_and_mismatched_lists():
    assert tuple(divergence_triple([], [])) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="tensors"):
        divergence_triple([torch.ones(1)], [torch.ones(1), torch.ones(1)])
