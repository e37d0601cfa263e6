"""Splitting a whole number of batches in proportion to per-rank weights (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction


def proportional_split(total: int, weights: Sequence[float | Fraction]) -> list[int]:
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


def balanced_split(total: int, weights: Sequence[int], held: Sequence[int]) -> list[int]:
    """Split `total` new batches so that what each rank then holds (`held` + its part) is in proportion to
    its weight, as near as whole batches allow; a rank that already holds more than its share gets none.

    With speeds as weights, ranks given their parts finish what they hold together."""
    if total < 0:
        raise ValueError(f"cannot split a negative total ({total})")
    if len(weights) != len(held):
        raise ValueError(f"one held count per weight ({len(weights)}), got {len(held)}")
    if not any(weights):
        weights = [1] * len(weights)
    sharing = [r for r, w in enumerate(weights) if w > 0]
    while True:  # drop the ranks over their share, then share again among the rest: at least one stays
        mass = sum(weights[r] for r in sharing)
        pool = total + sum(held[r] for r in sharing)
        over = {r for r in sharing if held[r] * mass > pool * weights[r]}
        if not over:
            break
        sharing = [r for r in sharing if r not in over]
    wants = [Fraction(0)] * len(weights)
    for r in sharing:
        wants[r] = Fraction(pool * weights[r], mass) - held[r]
    return proportional_split(total, wants)
