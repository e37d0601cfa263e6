"""NonFiniteWatch: the first non-finite loss step, kept on the device until a window boundary reads it."""

from __future__ import annotations

import torch

from flodl.worker.nonfinite import NonFiniteWatch

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


def test_a_long_window_grows_the_buffer_and_keeps_every_step():
    watch = NonFiniteWatch(CPU)
    for step in range(101, 101 + 1000):  # past the initial slots, twice over
        watch.observe(torch.tensor(float("nan") if step == 950 else 1.0), step)
    assert watch.take() == 950
    for step in range(1101, 1104):
        watch.observe(torch.tensor(1.0, requires_grad=True) * 2, step)  # a loss with a graph
    assert watch.take() is None
    watch.observe(torch.tensor(float("inf")), 1104)
    assert watch.take() == 1104


def test_nothing_observed_reports_nothing():
    assert NonFiniteWatch(CPU).take() is None
