"""NonFiniteWatch: the first non-finite loss step, kept on the device until a window boundary reads it."""

from __future__ import annotations

import torch

from flodl.runtime.nonfinite import NonFiniteWatch

CPU = torch.device("cpu")


def test_finite_losses_leave_nothing_to_report():
    watch = NonFiniteWatch(CPU)
    for step in range(1, 6):
        watch.observe(torch.tensor(0.5 * step), step)
    assert watch.take() is None


def test_the_first_bad_step_wins_over_later_ones():
    watch = NonFiniteWatch(CPU)
    watch.observe(torch.tensor(1.0), 1)
    watch.observe(torch.tensor(float("nan")), 2)
    watch.observe(torch.tensor(float("inf")), 3)
    watch.observe(torch.tensor(2.0), 4)
    assert watch.take() == 2


def test_take_starts_over():
    watch = NonFiniteWatch(CPU)
    watch.observe(torch.tensor(float("-inf")), 7)
    assert watch.take() == 7
    assert watch.take() is None
    watch.observe(torch.tensor(float("nan"), dtype=torch.bfloat16), 9)  # autocast losses
    assert watch.take() == 9

