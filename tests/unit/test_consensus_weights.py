"""Consensus weights: n^gamma mass with idle ranks at 0, skip on zero mass, and the two-collective form."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.averaging.weights import gamma_mass, is_mover, prescale_factors, rank_contribution


@dataclass(frozen=True)
class RoundWeights:
    """Every rank's share of one reduce, as the whole cohort sees it: the oracle the per-rank
    `prescale_factors` (what the run uses) must reproduce."""

    # Parameter weights n_k^gamma / Σ n^gamma: sum to 1, all 0 when the round is skipped.
    weights: list[float]
    # Float32 buffer weights: 1 / movers for each mover, 0 for idle ranks.
    buffer_weights: list[float]
    movers: list[bool]
    masses: list[float]
    total_mass: float
    # No rank carries mass: skip the reduce, everyone keeps its local state.
    skip: bool


def round_weights(
    steps: Sequence[int], gamma: float, exact: bool = False, kept: Sequence[bool] | None = None
) -> RoundWeights:
    masses = [gamma_mass(n, gamma) for n in steps]
    movers = [is_mover(n) for n in steps]
    kept = [True] * len(steps) if kept is None else list(kept)
    total_mass = math.fsum(masses)
    movers_count = sum(movers)
    if total_mass <= 0.0 and exact and any(kept):
        mean = [1.0 / sum(kept) if k else 0.0 for k in kept]
        return RoundWeights(mean, mean, movers, masses, total_mass, skip=False)
    skip = total_mass <= 0.0
    weights = [0.0 if skip else m / total_mass for m in masses]
    buffer_weights = [0.0 if skip or not moved else 1.0 / movers_count for moved in movers]
    return RoundWeights(weights, buffer_weights, movers, masses, total_mass, skip)


def approx_list(values, rel=1e-12, abs=1e-15):
    return pytest.approx(values, rel=rel, abs=abs)


# --- worked cases -----------------------------------------------------------------------------


def test_gamma_one_is_plain_work_weighting():
    w = round_weights([3, 1, 0], gamma=1.0)
    assert w.weights == approx_list([0.75, 0.25, 0.0])
    assert w.movers == [True, True, False]
    assert w.buffer_weights == approx_list([0.5, 0.5, 0.0])
    assert w.total_mass == 4.0
    assert not w.skip


def test_gamma_zero_is_the_unweighted_mean_over_movers_only():
    # 0^0 = 1 would hand the idle rank a third of the consensus.
    w = round_weights([5, 2, 0], gamma=0.0)
    assert w.weights == approx_list([0.5, 0.5, 0.0])
    assert w.masses == [1.0, 1.0, 0.0]


def test_gamma_minus_one_equalizes_per_step_trust_and_idle_ranks_do_not_divide_by_zero():
    w = round_weights([1, 4, 0], gamma=-1.0)
    assert w.masses == approx_list([1.0, 0.25, 0.0])
    assert w.weights == approx_list([0.8, 0.2, 0.0])


def test_gamma_half():
    w = round_weights([4, 9, 0, 1], gamma=0.5)
    assert w.masses == approx_list([2.0, 3.0, 0.0, 1.0])
    assert w.weights == approx_list([1 / 3, 1 / 2, 0.0, 1 / 6])
    assert w.buffer_weights == approx_list([1 / 3, 1 / 3, 0.0, 1 / 3])


@pytest.mark.parametrize("gamma", [0.0, -1.0, -0.5, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("steps", [0, -3])
def test_idle_ranks_weigh_zero_for_every_gamma(steps, gamma):
    assert gamma_mass(steps, gamma) == 0.0
    assert rank_contribution(steps, gamma) == (0.0, 0.0)


def test_true_step_count_is_not_floored_to_one():
    # 0.5.3 used max(n, 1): an idle rank would then count as one step.
    w = round_weights([2, 0], gamma=1.0)
    assert w.weights == [1.0, 0.0]


@pytest.mark.parametrize("gamma", [0.0, 1.0, -1.0, 0.5])
@pytest.mark.parametrize("steps", [[0, 0, 0], [0], []])
def test_all_idle_skips_the_round(steps, gamma):
    w = round_weights(steps, gamma)
    assert w.skip
    assert w.weights == [0.0] * len(steps)
    assert w.buffer_weights == [0.0] * len(steps)
    scale = prescale_factors(0, gamma, total_mass=0.0, total_movers=0.0)
    assert scale.skip
    assert (scale.param_factor, scale.buffer_factor) == (0.0, 0.0)


@pytest.mark.parametrize("gamma", [0.0, 1.0, -1.0])
def test_an_exact_round_nobody_moved_in_is_the_plain_mean_of_the_ranks_that_kept_their_window(gamma):
    # The last round of a run must leave every rank with the same state (EASGD left them apart).
    w = round_weights([0, 0, 0], gamma, exact=True)
    assert not w.skip and w.weights == w.buffer_weights == [1 / 3] * 3
    dropped = round_weights([0, 0, 0], gamma, exact=True, kept=[True, False, True])
    assert dropped.weights == dropped.buffer_weights == [0.5, 0.0, 0.5]
    assert round_weights([0, 0], gamma, exact=True, kept=[False, False]).skip  # nothing left to average
    assert round_weights([2, 0], gamma, exact=True).weights == [1.0, 0.0]  # a mover: weights as ever
    mine = prescale_factors(0, gamma, total_mass=0.0, total_movers=0.0, exact=True, kept=True, total_kept=2)
    assert not mine.skip and (mine.param_factor, mine.buffer_factor) == (0.5, 0.5)
    theirs = prescale_factors(0, gamma, 0.0, 0.0, exact=True, kept=False, total_kept=2)
    assert not theirs.skip and (theirs.param_factor, theirs.buffer_factor) == (0.0, 0.0)
    assert prescale_factors(0, gamma, 0.0, 0.0, exact=True, kept=False, total_kept=0).skip
    assert prescale_factors(0, gamma, 0.0, 0.0, exact=False, total_kept=2).skip


def test_bad_gamma_and_overflow_are_refused():
    with pytest.raises(ValueError, match="finite"):
        gamma_mass(3, math.nan)
    with pytest.raises(ValueError, match="overflows"):
        gamma_mass(10**6, 1000.0)


# --- properties -------------------------------------------------------------------------------

steps_lists = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=16)
gammas = st.floats(min_value=-3.0, max_value=3.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(steps=steps_lists, gamma=gammas)
def test_weights_sum_to_one_and_are_proportional_to_n_pow_gamma(steps, gamma):
    w = round_weights(steps, gamma)
    movers = [k for k, n in enumerate(steps) if n > 0]
    assert w.skip == (not movers)
    if w.skip:
        return
    assert math.fsum(w.weights) == pytest.approx(1.0, rel=1e-12)
    assert math.fsum(w.buffer_weights) == pytest.approx(1.0, rel=1e-12)
    for k, n in enumerate(steps):
        if n == 0:
            assert w.weights[k] == 0.0 and w.buffer_weights[k] == 0.0
    ref = movers[0]
    for k in movers:
        # weight ratios follow (n_k / n_ref)^gamma, independently of how the total is formed.
        assert w.weights[k] / w.weights[ref] == pytest.approx((steps[k] / steps[ref]) ** gamma, rel=1e-9)
        assert w.buffer_weights[k] == pytest.approx(1.0 / len(movers), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(steps=steps_lists, gamma=gammas)
def test_factors_from_reduced_totals_match_the_cohort_weights(steps, gamma):
    contributions = [rank_contribution(n, gamma) for n in steps]
    total_mass = math.fsum(c[0] for c in contributions)  # the SUM all-reduce
    total_movers = math.fsum(c[1] for c in contributions)
    w = round_weights(steps, gamma)
    for k, n in enumerate(steps):
        scale = prescale_factors(n, gamma, total_mass, total_movers)
        assert scale.skip == w.skip
        assert scale.param_factor == pytest.approx(w.weights[k], rel=1e-12, abs=1e-300)
        assert scale.buffer_factor == pytest.approx(w.buffer_weights[k], rel=1e-12, abs=1e-300)


# --- the distributed recipe reproduces the weighted mean --------------------------------------


def simulated_reduce(steps, gamma, tensors, kind):
    """What the runtime does: SUM-reduce [n^gamma, mover], pre-scale locally, SUM-reduce the tensors."""
    totals = torch.tensor([rank_contribution(n, gamma) for n in steps], dtype=torch.float64).sum(0)
    out = torch.zeros_like(tensors[0])
    for n, t in zip(steps, tensors, strict=True):
        scale = prescale_factors(n, gamma, float(totals[0]), float(totals[1]))
        assert not scale.skip
        out += t * (scale.param_factor if kind == "param" else scale.buffer_factor)
    return out


def relative_error(got, expected):
    return float(torch.linalg.vector_norm(got.double() - expected) / torch.linalg.vector_norm(expected))


@pytest.mark.parametrize("gamma", [1.0, 0.0, -1.0, 0.5, 2.0])
@pytest.mark.parametrize("seed", range(5))
def test_prescaled_sum_is_the_weighted_mean(seed, gamma):
    gen = torch.Generator().manual_seed(seed)
    world = 2 + seed
    steps = torch.randint(0, 50, (world,), generator=gen)
    steps[seed % world] = 7  # at least one mover
    params = [torch.randn(33, 17, generator=gen) for _ in range(world)]

    got = simulated_reduce(steps.tolist(), gamma, params, "param")

    # Hand-computed in float64: mass = n^gamma for movers, 0 for idle ranks.
    n = steps.double()
    mass = torch.where(n > 0, n.clamp(min=1.0) ** gamma, torch.zeros_like(n))
    stacked = torch.stack(params).double()
    expected = (mass[:, None, None] * stacked).sum(0) / mass.sum()
    assert relative_error(got, expected) <= 1e-6

    movers = (n > 0).double()
    expected_buffers = (movers[:, None, None] * stacked).sum(0) / movers.sum()
    assert relative_error(simulated_reduce(steps.tolist(), gamma, params, "buffer"), expected_buffers) <= 1e-6


@pytest.mark.parametrize("gamma", [0.0, -1.0, 1.0])
def test_idle_rank_params_do_not_reach_the_consensus(gamma):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(10, generator=gen) for _ in range(3)]
    steps = [4, 0, 2]
    before = simulated_reduce(steps, gamma, params, "param")
    params[1] = params[1] + 1000.0
    assert torch.equal(simulated_reduce(steps, gamma, params, "param"), before)
