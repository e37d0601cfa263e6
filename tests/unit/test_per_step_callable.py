"""Config partials called every step (loss, eval, transform) are authorized by Hydra once, then called
directly with the same bound arguments."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from flodl.worker.task_setup import per_step_callable

LOSS = {"_target_": "torch.nn.functional.cross_entropy", "_partial_": True, "label_smoothing": 0.1}


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 5, generator=gen), torch.randint(0, 5, (8,), generator=gen)


def test_bound_arguments_hold_on_the_first_call_and_after():
    loss = per_step_callable(instantiate(LOSS))
    for seed in range(3):
        logits, labels = inputs(seed)
        assert torch.equal(loss(logits, labels), F.cross_entropy(logits, labels, label_smoothing=0.1))


def test_hydra_checks_the_first_call_only(monkeypatch):
    deferred = instantiate(LOSS)
    if type(deferred) is functools.partial:
        pytest.skip("this Hydra returns plain partials: nothing is checked per call")
    checked = []
    original = type(deferred).__call__

    def counting(self, *args, **kwargs):
        checked.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(deferred), "__call__", counting)
    loss = per_step_callable(deferred)
    for seed in range(4):
        loss(*inputs(seed))
    assert len(checked) == 1


def test_plain_callables_are_returned_as_they_are():
    plain = functools.partial(F.cross_entropy, label_smoothing=0.2)
    assert per_step_callable(plain) is plain
    assert per_step_callable(F.mse_loss) is F.mse_loss
