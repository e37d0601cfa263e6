"""Consensus weights for a local-SGD reduce (pure: no torch.distributed, no I/O).

For one window, n_k = optimizer steps rank k took since the last reduce (the true count, never
floored to 1). Parameters average as θ = Σ n_k^gamma θ_k / Σ n_k^gamma; float32 buffers average with equal
weight among the ranks that moved (n_k > 0); other buffers stay local. Idle ranks weigh 0 yet still
join every collective, so nobody stalls; when the total mass is 0 the round is skipped and every
rank keeps its local state rather than adopt a mean of nothing — unless the round is exact (the last of a
run or before a checkpoint), which must leave every rank with the same state: then the ranks take their
plain mean, leaving out any rank whose window was dropped for a non-finite loss (`kept=False`).

The distributed form needs two collectives: each rank all-reduces (SUM) its tiny
`rank_contribution(n, gamma) = [n^gamma, mover]` (with n and kept beside it), derives its own pre-scale
factors from the totals with `prescale_factors`, multiplies its params/buffers by them, and one big SUM
all-reduce then yields the consensus directly (the original does the pre-scaling with NCCL's PreMulSum).
"""

from __future__ import annotations

import math
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
