"""Splitting a whole number of batches in proportion to per-rank weights (pure)."""

from __future__ import annotations

from fractions import Fraction


def proportional_split(total: int, weights: list[int] | list[float]) -> list[int]:
    """Largest-remainder split of `total` by `weights`: sums to `total` exactly.

    Ties on the remainder go to the lower rank; all-zero weights split evenly.
    """
    if total < 0:
        raise ValueError(f"cannot split a negative total ({total})")
    # Exact rational arithmetic: float shares turn equal remainders into unequal ones.
    mass = sum(Fraction(w) for w in weights)
    shares = [Fraction(w) / mass for w in weights] if mass > 0 else [Fraction(1, len(weights))] * len(weights)
    exact = [total * s for s in shares]
    parts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(exact[r] - parts[r]), r))
    for r in by_remainder[: total - sum(parts)]:
        parts[r] += 1
    return parts
