"""Convergence guards: TrendGuard's three-rises rule, MsfGuard's growth rate, NoGuard, factory, state."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.rounds.guard import (
    STABLE,
    SUPPRESS_GROWTH,
    Action,
    DivergenceReport,
    MsfGuard,
    NoGuard,
    TrendGuard,
    Verdict,
    guard_from_state,
    make_guard,
)


def rep(*divergences: float) -> DivergenceReport:
    return DivergenceReport(list(divergences))


def feed(guard, values, k_max=4):
    return [guard.report(rep(v), k_max) for v in values]


def verdicts(actions):
    return [a.verdict for a in actions]


S, G, N = Verdict.STABLE, Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN

# --- DivergenceReport -------------------------------------------------------------------------


def test_report_signal_is_the_worst_rank():
    assert rep(0.01, 0.05, 0.03).max_divergence() == 0.05
    assert rep().max_divergence() == 0.0
    assert rep(math.nan, 0.02).max_divergence() == 0.02


# --- NoGuard ----------------------------------------------------------------------------------


def test_no_guard_is_always_stable():
    assert set(verdicts(feed(NoGuard(), [0.1 * 2**i for i in range(10)]))) == {S}


# --- TrendGuard -------------------------------------------------------------------------------


def test_three_rising_values_above_threshold_suppress_growth():
    assert verdicts(feed(TrendGuard(0.05), [0.06, 0.07, 0.08])) == [S, S, G]


def test_two_rising_values_are_not_enough():
    assert verdicts(feed(TrendGuard(0.05), [0.5, 0.9])) == [S, S]
    # A high value, then a dip, then two rises: only two values in the rising run.
    assert verdicts(feed(TrendGuard(0.05), [0.9, 0.1, 0.2])) == [S, S, S]


def test_rises_below_threshold_are_stable():
    assert verdicts(feed(TrendGuard(0.05), [0.01, 0.02, 0.03, 0.04, 0.049])) == [S] * 5


def test_only_the_latest_value_must_exceed_the_threshold():
    assert verdicts(feed(TrendGuard(0.05), [0.01, 0.02, 0.06])) == [S, S, G]


def test_a_dip_in_between_breaks_the_run():
    guard = TrendGuard(0.05)
    assert verdicts(feed(guard, [0.06, 0.08, 0.07, 0.09])) == [S, S, S, S]
    # [0.07, 0.09, 0.10] is a fresh run of three.
    assert verdicts(feed(guard, [0.10])) == [G]


def test_flat_values_are_not_rises():
    assert verdicts(feed(TrendGuard(0.05), [0.1, 0.1, 0.1, 0.1])) == [S] * 4


def test_a_sustained_rise_keeps_suppressing_and_never_nudges():
    assert verdicts(feed(TrendGuard(0.05), [0.1, 0.2, 0.3, 0.4, 0.5])) == [S, S, G, G, G]


def test_trend_uses_the_worst_rank():
    guard = TrendGuard(0.05)
    for d in (0.06, 0.07, 0.08):
        action = guard.report(rep(0.001, d), 4)
    assert action == SUPPRESS_GROWTH


def test_rises_parameter_lengthens_the_run():
    assert verdicts(feed(TrendGuard(0.05, rises=4), [0.1, 0.2, 0.3, 0.4])) == [S, S, S, G]


def test_history_is_a_ring_of_five():
    guard = TrendGuard(0.05)
    feed(guard, [0.01 * i for i in range(10)])
    assert list(guard.history) == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=30))
def test_trend_rule_holds_for_any_sequence(values):
    actions = feed(TrendGuard(0.05), values)
    for t, action in enumerate(actions):
        a, b, c = [math.nan, math.nan, *values][t : t + 3]
        expected = G if (t >= 2 and a < b < c and c > 0.05) else S
        assert action.verdict == expected
        assert action.verdict != N


# --- factory ----------------------------------------------------------------------------------


def test_factory_defaults():
    overwrite = make_guard("trend", None, easgd=False)
    assert isinstance(overwrite, TrendGuard) and overwrite.threshold == 0.05
    easgd = make_guard("trend", None, easgd=True)
    assert isinstance(easgd, TrendGuard) and easgd.threshold == 0.3
    explicit = make_guard("trend", 0.2, easgd=True)
    assert isinstance(explicit, TrendGuard) and explicit.threshold == 0.2
    assert isinstance(make_guard("none", None, easgd=False), NoGuard)


def test_easgd_guard_tolerates_rises_up_to_point_three():
    assert verdicts(feed(make_guard("trend", None, True), [0.1, 0.2, 0.29])) == [S, S, S]
    assert verdicts(feed(make_guard("trend", None, True), [0.1, 0.2, 0.31])) == [S, S, G]
    assert verdicts(feed(make_guard("trend", None, False), [0.1, 0.2, 0.29])) == [S, S, G]


# --- MsfGuard ---------------------------------------------------------------------------------


def exponential(rate, k_max, n, start=0.01):
    """D_t growing by exp(rate) per optimizer step, k_max steps per window."""
    return [start * math.exp(rate * k_max * t) for t in range(n)]


def test_msf_lambda_is_log_ratio_per_step():
    guard = MsfGuard()
    feed(guard, [0.01, 0.02], k_max=4)
    # Bias correction: after one sample the EMA equals it.
    assert guard.ema_t == 1 and guard.lambda_ema() == pytest.approx(math.log(2) / 4)


def test_msf_fast_exponential_growth_nudges_down_after_three_sustained_reports():
    actions = feed(MsfGuard(), exponential(0.05, 4, 12), k_max=4)
    # Report 0 has no predecessor, reports 1-3 build the streak; the 4th fires.
    assert verdicts(actions[:3]) == [S, S, S]
    assert actions[3] == Action(Verdict.NUDGE_DOWN, 0.5)
    assert all(a.verdict != S for a in actions[3:5])  # suppress fires right after the nudge
    assert sum(a.verdict == N for a in actions) >= 3


def test_msf_slow_growth_suppresses_without_nudging():
    actions = feed(MsfGuard(), exponential(5e-3, 4, 12), k_max=4)
    assert verdicts(actions[:4]) == [S, S, S, G]
    assert N not in verdicts(actions)


@pytest.mark.parametrize("values", [[0.2] * 20, exponential(-0.05, 4, 20)], ids=["flat", "decaying"])
def test_msf_flat_or_decaying_signal_is_stable(values):
    assert set(verdicts(feed(MsfGuard(), values, k_max=4))) == {S}


def test_msf_rate_is_normalised_by_steps_per_window():
    values = [0.01 * 1.02**t for t in range(10)]  # +2% per window
    assert N in verdicts(feed(MsfGuard(), values, k_max=1))  # 0.0198 per step
    assert set(verdicts(feed(MsfGuard(), values, k_max=100))) == {S}  # 0.000198 per step


def test_msf_noise_floor_restarts_the_pairing():
    guard = MsfGuard()
    feed(guard, [0.01, 1e-12])
    assert guard.lambda_ema() is None
    feed(guard, [0.02])  # predecessor was below the floor: no rate
    assert guard.lambda_ema() is None
    feed(guard, [0.04], k_max=4)
    assert guard.ema_t == 1 and guard.lambda_ema() == pytest.approx(math.log(2) / 4)


def test_msf_without_nudge_only_suppresses():
    actions = feed(MsfGuard(nudge_threshold=None), exponential(0.05, 4, 12), k_max=4)
    assert actions[3] == SUPPRESS_GROWTH
    assert N not in verdicts(actions)


# --- state round trips ------------------------------------------------------------------------


def json_round_trip(guard):
    return guard_from_state(json.loads(json.dumps(guard.state(), allow_nan=False)))


@pytest.mark.parametrize(
    "make",
    [
        NoGuard,
        lambda: TrendGuard(0.05),
        lambda: TrendGuard(0.3, rises=4),
        MsfGuard,
        lambda: MsfGuard(nudge_threshold=None),
    ],
)
def test_state_round_trips_through_json_and_continues_identically(make):
    guard = make()
    history = exponential(0.03, 4, 4)
    feed(guard, history, k_max=4)
    restored = json_round_trip(guard)
    assert type(restored) is type(guard)
    assert restored.state() == guard.state()
    future = [*exponential(0.03, 4, 6, start=history[-1] * 1.1), 0.01, 0.02]
    assert feed(restored, future, k_max=4) == feed(guard, future, k_max=4)


def test_restored_trend_history_skips_the_warm_up():
    saved = TrendGuard(0.05)
    feed(saved, [0.06, 0.07])
    assert json_round_trip(saved).report(rep(0.08), 4) == SUPPRESS_GROWTH
    assert TrendGuard(0.05).report(rep(0.08), 4) == STABLE


def test_unknown_guard_state_is_refused():
    with pytest.raises(ValueError, match="unknown guard"):
        guard_from_state({"kind": "mystery"})


# --- per-window divergence slots (pitfall 6) --------------------------------------------------


def test_factory_builds_the_growth_rate_guard_on_request():
    assert isinstance(make_guard("msf", None, easgd=False), MsfGuard)
