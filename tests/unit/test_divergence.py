"""The divergence ||pre - post|| / ||post||: global over the tensors, float64 accumulation, one sync."""

from __future__ import annotations

import math

import pytest
import torch

from flodl.averaging.divergence import POST_NORM_FLOOR, DivergenceSums, divergence


def flat(tensors):
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def hand_divergence(pre, post):
    p, q = flat(pre), flat(post)
    return float((p - q).norm() / q.norm())


def test_single_tensor_by_hand():
    assert divergence([torch.tensor([3.0, 4.0])], [torch.tensor([6.0, 8.0])]) == pytest.approx(0.5, rel=1e-12)


def test_norms_are_global_over_all_tensors():
    pre = [torch.tensor([3.0, 4.0]), torch.tensor([[0.0, 12.0]])]
    post = [torch.tensor([0.0, 0.0]), torch.tensor([[0.0, 5.0]])]  # ||post|| = 5, ||diff|| = sqrt(74)
    assert divergence(pre, post) == pytest.approx(math.sqrt(74.0) / 5.0, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_random_models_match_a_float64_hand_computation(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (10, 64), (10,), (3, 3, 4, 4)]
    post = [torch.randn(s, generator=gen) for s in shapes]
    pre = [q + 0.01 * torch.randn(q.shape, generator=gen) for q in post]
    assert divergence(pre, post) == pytest.approx(hand_divergence(pre, post), rel=1e-6)


def test_sums_over_pieces_equal_the_whole():
    # How the device backend measures a chunked round: one `add` per chunk, one read.
    gen = torch.Generator().manual_seed(9)
    post = torch.randn(100, generator=gen)
    pre = post + torch.randn(100, generator=gen)
    sums = DivergenceSums()
    for span in (slice(0, 30), slice(30, 64), slice(64, 100)):
        sums.add([pre[span]], [post[span]])
    pieces = sums.read()
    assert pieces == pytest.approx(divergence([pre], [post]), rel=1e-12)
    assert pieces == pytest.approx(hand_divergence([pre], [post]), rel=1e-6)
    sums.reset()
    sums.add([post + 1.0], [post])  # a reset forgets the previous round's pieces
    assert sums.read() == pytest.approx(10.0 / float(post.double().norm()), rel=1e-6)


def test_identical_pre_and_post_diverge_by_zero():
    post = [torch.randn(5, 5), torch.randn(7)]
    assert divergence([t.clone() for t in post], post) == 0.0


def test_zero_post_norm_gives_zero_divergence_not_nan():
    d = divergence([torch.ones(4)], [torch.zeros(4)])
    assert d == 0.0 and not math.isnan(d)


def test_post_norm_at_the_floor_gives_zero_and_just_above_it_the_ratio():
    floor = torch.full((1,), POST_NORM_FLOOR, dtype=torch.float64)
    assert divergence([floor + 1.0], [floor]) == 0.0
    assert divergence([2 * floor + 1.0], [2 * floor]) == pytest.approx(0.5 / POST_NORM_FLOOR, rel=1e-9)


def test_accumulates_in_float64():
    # Squares of 1e20 overflow float32: a float32 accumulation would report inf or nan.
    d = divergence([torch.full((4,), 1e20)], [torch.full((4,), 2e20)])
    assert d == pytest.approx(0.5, rel=1e-6)


def test_in_place_turns_pre_into_the_difference_and_default_leaves_it_alone():
    post = [torch.randn(6), torch.randn(2, 3)]
    pre = [q + 1.0 for q in post]
    kept = [t.clone() for t in pre]
    out_of_place = divergence(pre, post)
    assert all(torch.equal(a, b) for a, b in zip(pre, kept, strict=True))
    in_place = divergence(pre, post, in_place=True)
    assert in_place == pytest.approx(out_of_place, rel=1e-12)
    for p, k, q in zip(pre, kept, post, strict=True):
        assert torch.equal(p, k - q)


def test_parameters_that_require_grad_work_in_place():
    pre = [torch.nn.Parameter(torch.ones(3))]
    assert divergence(pre, [torch.full((3,), 2.0)], in_place=True) == pytest.approx(0.5)


def test_bf16_consensus_against_float32_scratch():
    post32 = [torch.tensor([6.0, 8.0]), torch.tensor([2.0, 4.0])]  # bf16-exact values
    pre = [torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0])]
    ref = divergence(pre, post32)
    assert ref == pytest.approx(hand_divergence(pre, post32), rel=1e-12)
    assert divergence(pre, [t.bfloat16() for t in post32]) == pytest.approx(ref, rel=1e-12)


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
    divergence([q * 1.5 for q in post], post)
    assert len(reads) == 1


def test_empty_and_mismatched_lists():
    assert divergence([], []) == 0.0
    with pytest.raises(ValueError, match="tensors"):
        divergence([torch.ones(1)], [torch.ones(1), torch.ones(1)])
