"""The group a rank trains and averages with (flodl/worker/group.py): the fixed world raises what failed;
survive's group carries a change out for its worker (let go, form, settle, say so) and retries while the
forming fails, over a real one-rank gloo group and a real store inbox."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from flodl.links.messages import Joined, Regroup, Shutdown
from flodl.worker.group import FixedGroup
from tests.helpers.one_rank_group import Member, surviving


def test_the_fixed_world_is_generation_0_of_every_rank_and_raises_what_failed() -> None:
    group = FixedGroup(rank=2, world_size=4)
    assert (group.generation, group.size, group.index, group.joining, group.aborted) == (
        0,
        4,
        2,
        False,
        False,
    )
    cause = ValueError("a peer's socket closed")
    with pytest.raises(ValueError, match="a peer's socket closed"):
        group.failed("round 3 was cut", cause, Member())
    with pytest.raises(RuntimeError, match="a Regroup without fault_tolerance=survive"):
        group.change(Regroup(1, [0, 1]), Member())
    with pytest.raises(RuntimeError, match="cuts no round"):
        group.back_to_round_start([torch.zeros(2)])
    said: list[str] = []
    group.say_state(lambda: said.append("read") or "")  # type: ignore[func-returns-value]
    assert said == [], "nothing is read for a state nobody compares"


def test_a_failure_is_carried_out_as_the_next_change_retried_while_the_forming_fails() -> None:
    group, coordinator = surviving()
    member = Member()
    group.start(member, before_start=lambda: None)
    assert (group.generation, member.calls) == (0, ["settle 0"])
    member.calls.clear()
    member.failing = 1
    coordinator.send(0, Regroup(1, [0], cut_round=3))
    threading.Timer(0.3, coordinator.send, args=(0, Regroup(2, [0]))).start()
    group.failed("round 3 was cut", RuntimeError("a peer's socket closed"), member)
    assert member.calls == ["let go for 1", "settle 1", "let go for 2", "settle 2", "regrouped 2"]
    assert group.generation == 2
    group.change(Regroup(2, [0]), member)  # the group it is already: nothing to do
    assert member.calls[-1] == "regrouped 2"


def test_a_round_start_is_kept_and_gone_back_to() -> None:
    group, _ = surviving()
    state = [torch.ones(3), torch.full((2,), 2.0)]
    group.keep_round_start(state)
    for tensor in state:
        tensor.mul_(5)
    group.back_to_round_start(state)
    assert [t.tolist() for t in state] == [[1.0] * 3, [2.0] * 2]


def test_a_restart_says_it_joined_and_waits_for_its_admission() -> None:
    group, coordinator = surviving(incarnation=1)
    member = Member()
    coordinator.send(0, Regroup(1, [0], joining=[0], shares_state=True))
    group.start(member, before_start=lambda: pytest.fail("a restart injects no start fault"))
    (joined,) = member.reports
    assert isinstance(joined, Joined) and joined.incarnation == 1
    assert member.calls == ["let go for 1", "settle 1", "regrouped 1"]


def test_a_restart_the_run_ended_before_admitting_says_no_state(caplog: pytest.LogCaptureFixture) -> None:
    # Its model is a fresh one, no member's: a state line from it would read as the members disagreeing.
    group, coordinator = surviving(incarnation=1)
    member = Member()
    coordinator.send(0, Shutdown("done"))
    group.start(member, before_start=lambda: None)
    assert member.calls == [], "never admitted: nothing formed"
    said: list[str] = []
    with caplog.at_level(logging.INFO, logger="flodl"):
        group.say_state(lambda: said.append("read") or "fresh")  # type: ignore[func-returns-value]
    assert said == [] and "state after" not in caplog.text
