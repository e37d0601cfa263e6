"""Consensus weights for a local-SGD reduce (pure: no torch.distributed, no I/O).

For one window, n_k = optimizer steps rank k took since the last reduce (the true count, never
floored to 1). Parameters average as θ = Σ n_k^gamma θ_k / Σ n_k^gamma; float32 buffers average with equal
weight among the ranks that moved (n_k > 0); other buffers stay local. Idle ranks weigh 0 yet still
join every collective, so nobody stalls; when the total mass is 0 the round is skipped and every
rank keeps its local state (reference §3.2, §3.4, pitfall 4) — unless the round is exact (the last of a
run or before a checkpoint), which must leave every rank with the same state: then the ranks take their
plain mean, leaving out any rank whose window was dropped for a non-finite loss (`kept=False`).

The distributed form needs two collectives: each rank all-reduces (SUM) its tiny
`rank_contribution(n, gamma) = [n^gamma, mover]` (with n and kept beside it), derives its own pre-scale
factors from the totals with `prescale_factors`, multiplies its params/buffers by them, and one big SUM
all-reduce then yields the consensus directly (what NCCL PreMulSum does in the original).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def is_mover(steps: int) -> bool:
    return steps > 0


def gamma_mass(steps: int, gamma: float) -> float:
    """n^gamma for a rank that moved, 0 for an idle one.

    The idle test comes first on purpose: 0^0 = 1 would give idle ranks full weight at gamma = 0, and
    0^gamma for gamma < 0 divides by zero.
    """
    if not math.isfinite(gamma):
        raise ValueError(f"gamma must be finite, got {gamma}")
    if not is_mover(steps):
        return 0.0
    if gamma == 1.0:
        return float(steps)  # exact plain work weighting, no pow rounding
    try:
        mass = float(steps) ** gamma
    except OverflowError:
        mass = math.inf
    if not math.isfinite(mass):
        raise ValueError(f"consensus mass {steps}^{gamma} overflows float64; use a smaller |gamma|")
    return mass


@dataclass(frozen=True)
class RoundWeights:
    """Every rank's share of one reduce, as the whole cohort sees it."""

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


def rank_contribution(steps: int, gamma: float) -> tuple[float, float]:
    """What one rank puts into the small SUM all-reduce: `[n^gamma, mover]`.

    Reduce it in float64: float32 totals would round large n^gamma sums.
    """
    return gamma_mass(steps, gamma), 1.0 if is_mover(steps) else 0.0


@dataclass(frozen=True)
class PreScale:
    """One rank's multipliers before the big SUM all-reduce."""

    # The cohort's total mass is 0: skip the param and buffer reduce on every rank (each rank
    # sees the same totals, so the skip is collectively consistent).
    skip: bool
    # n^gamma / Σ n^gamma for params.
    param_factor: float
    # mover / Σ mover for float32 buffers.
    buffer_factor: float


def prescale_factors(
    steps: int,
    gamma: float,
    total_mass: float,
    total_movers: float,
    *,
    exact: bool = False,
    kept: bool = True,
    total_kept: float = 0.0,
) -> PreScale:
    """Derive this rank's factors from the all-reduced `[Σ n^gamma, Σ mover]` totals (and `Σ kept`, the
    ranks that kept their window, for an exact round nobody moved in)."""
    if total_mass <= 0.0:
        if exact and total_kept > 0.0:
            share = (1.0 if kept else 0.0) / total_kept
            return PreScale(skip=False, param_factor=share, buffer_factor=share)
        return PreScale(skip=True, param_factor=0.0, buffer_factor=0.0)
    mass, mover = rank_contribution(steps, gamma)
    # total_movers >= 1 whenever total_mass > 0; the guard only keeps a float mishap from dividing by 0.
    buffer_factor = mover / total_movers if total_movers > 0.0 else 0.0
    return PreScale(skip=False, param_factor=mass / total_mass, buffer_factor=buffer_factor)
