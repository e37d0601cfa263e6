"""Outer optimizers against their formulas, over several rounds (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch

from flodl.averaging.outer import OuterOptimizer, OuterSettings

ROUNDS = 5


def consensus_sequence(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator)] for _ in range(ROUNDS)
    ]


def initial() -> list[torch.Tensor]:
    return [torch.ones(4, 3), torch.full((5,), -0.5)]


def by_formula(kind: str, lr: float, mu: float, rounds: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """v = mu v + g, g = prev - consensus; slowmo: prev - lr v; diloco: prev - lr (mu v + g)."""
    prev = [t.double() for t in initial()]
    velocity = [torch.zeros_like(t) for t in prev]
    out = []
    for consensus in rounds:
        g = [p - c.double() for p, c in zip(prev, consensus, strict=True)]
        velocity = [mu * v + gi for v, gi in zip(velocity, g, strict=True)]
        step = velocity if kind == "slowmo" else [mu * v + gi for v, gi in zip(velocity, g, strict=True)]
        prev = [p - lr * s for p, s in zip(prev, step, strict=True)]
        out.append(prev)
    return out


@pytest.mark.parametrize(
    ("kind", "lr", "mu"), [("slowmo", 1.0, 0.9), ("diloco", 0.7, 0.9), ("diloco", 0.3, 0.5)]
)
def test_outer_steps_follow_the_formula_over_several_rounds(kind: str, lr: float, mu: float) -> None:
    rounds = consensus_sequence(seed=3)
    outer = OuterOptimizer(OuterSettings(kind, lr, mu), initial())
    expected = by_formula(kind, lr, mu, rounds)
    for consensus, want in zip(rounds, expected, strict=True):
        adopted = [c.clone() for c in consensus]
        outer.step(adopted)  # the new global replaces the consensus in place
        for got, ref, glob in zip(adopted, want, outer.global_params, strict=True):
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(glob, got)


def test_diloco_is_torch_nesterov_sgd_on_the_pseudo_gradient() -> None:
    rounds = consensus_sequence(seed=7)
    outer = OuterOptimizer(OuterSettings("diloco", 0.7, 0.9), initial())
    params = [t.clone().requires_grad_(True) for t in initial()]
    reference = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    for consensus in rounds:
        for p, c in zip(params, consensus, strict=True):
            p.grad = p.detach() - c
        reference.step()
        adopted = [c.clone() for c in consensus]
        outer.step(adopted)
        for got, want in zip(adopted, params, strict=True):
            torch.testing.assert_close(got, want.detach())


def test_settings_defaults_and_avg() -> None:
    assert OuterSettings.resolve("avg", None, None) is None
    assert OuterSettings.resolve("diloco", None, None) == OuterSettings("diloco", 0.7, 0.9, True)
    assert OuterSettings.resolve("slowmo", None, 0.5) == OuterSettings("slowmo", 1.0, 0.5, False)
    assert not OuterSettings.resolve("diloco", None, None, reset_inner=False).resets_inner  # type: ignore[union-attr]
    assert OuterSettings.resolve("slowmo", None, None, reset_inner=True).resets_inner  # type: ignore[union-attr]


def test_first_round_from_the_initial_global_moves_by_lr_times_the_change() -> None:
    # One round, no momentum history: slowmo with lr 1 adopts the consensus itself.
    outer = OuterOptimizer(OuterSettings("slowmo", 1.0, 0.9), initial())
    consensus = [torch.zeros(4, 3), torch.zeros(5)]
    outer.step(consensus)
    assert all(torch.equal(c, torch.zeros_like(c)) for c in consensus)
