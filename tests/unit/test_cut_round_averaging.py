"""A cut round under fault_tolerance=survive leaves the averaging where it began (flodl/averaging/): the outer
optimizer's global parameters and momentum, a delta wire's reference and a quantized wire's error feedback go
back with the rank's state, so that the round's second run starts every member from the same place; and a
joiner receives what the rounds keep alike. Both backends, over a real one-rank gloo group; and sync's
gradient buckets under survive cross the wire as `bf16_wire` says."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from flodl.averaging.consensus import DeviceAverager, HostAverager
from flodl.averaging.ddp_hooks import SettledBuckets, settled_gradient_hook
from flodl.averaging.outer import OuterSettings
from flodl.averaging.wire import wire_for
from flodl.worker.group import SurvivingGroup
from tests.helpers.one_rank_group import Member, surviving

Averager = DeviceAverager | HostAverager
# (outer optimizer, wire): each kind of averaging state a round changes.
KINDS = {
    "diloco-int8": ("diloco", wire_for(False, "int8")),  # global, momentum, feedback
    "slowmo-fp32": ("slowmo", wire_for(False, None)),  # global, momentum
    "avg-bf16": ("avg", wire_for(True, None)),  # the reference
    "avg-int4": ("avg", wire_for(False, "int4")),  # the reference and the feedback
    "avg-fp32": ("avg", wire_for(False, None)),  # nothing: the parameters alone
}
# The kinds whose rounds change some averaging state (on one rank the consensus is the rank's own).
STATEFUL = [kind for kind in KINDS if kind != "avg-fp32"]


@pytest.fixture
def group() -> Iterator[SurvivingGroup]:
    formed, coordinator = surviving()
    formed.start(Member(), before_start=lambda: None)
    yield formed
    formed.reader.stop(coordinator)


def averager(group: SurvivingGroup, backend: str, kind: str, seed: int = 0) -> tuple[Averager, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Linear(40, 30)  # 1,230 parameters: a quantized wire's last block is a partial one
    outer, wire = KINDS[kind]
    settings = OuterSettings.resolve(outer, None, None)
    device = torch.device("cpu")
    if backend == "device":
        return DeviceAverager(model, 1.0, device, wire, settings, group=group), model
    return HostAverager(model, 1.0, device, group, wire, settings), model


def train(model: nn.Module, seed: int) -> None:
    """A window's worth of change."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)


def run_round(averager: Averager) -> None:
    averager.begin(steps=3)
    averager.finish()
    averager.adopt(None, None)


def into_second_window(group: SurvivingGroup, backend: str, kind: str) -> tuple[Averager, nn.Module]:
    """An averager after a first round (its momentum and feedback hold something) and a window's training."""
    avg, model = averager(group, backend, kind)
    train(model, 1)
    run_round(avg)
    train(model, 2)
    return avg, model


def averaging_state(averager: Averager) -> list[Tensor]:
    """The averaging a round changes, as a test reads it from outside."""
    held = [t.clone() for t in averager.outer.state_tensors()] if averager.outer is not None else []
    held += [t.clone() for t in averager.refs or []]
    return held + [t.clone() for t in averager.reducer.feedback_state().values()]


def model_state(model: nn.Module) -> list[Tensor]:
    return [t.detach().clone() for t in model.parameters()]


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("kind", STATEFUL)
def test_a_round_finished_here_and_cut_elsewhere_goes_back_whole(
    group: SurvivingGroup, backend: str, kind: str
) -> None:
    avg, model = into_second_window(group, backend, kind)
    before, params = averaging_state(avg), model_state(model)
    run_round(avg)
    after = averaging_state(avg)
    assert not same(after, before), "the round changed no averaging state: the test would prove nothing"
    avg.restore_pre_round()  # an exact round finished here, cut elsewhere
    assert same(averaging_state(avg), before) and same(model_state(model), params)


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_kept_blend_round_gives_back_only_the_averaging(
    group: SurvivingGroup, backend: str, kind: str
) -> None:
    avg, model = into_second_window(group, backend, kind)
    before = averaging_state(avg)
    run_round(avg)
    blended = model_state(model)
    avg.restore_averaging()  # an EASGD round kept here, run again with the others
    assert same(averaging_state(avg), before) and same(model_state(model), blended)


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_round_cut_here_before_it_finished_goes_back(
    group: SurvivingGroup, backend: str, kind: str
) -> None:
    avg, model = into_second_window(group, backend, kind)
    before, params = averaging_state(avg), model_state(model)
    avg.begin(steps=3)  # the device's reduce runs in place; the host's thread reduces its copy
    avg.discard_round()
    assert same(averaging_state(avg), before) and same(model_state(model), params)


def replicated(averager: Averager) -> list[Tensor]:
    """What every member holds alike: the outer optimizer's global parameters and momentum, or the
    reference."""
    return averager.outer.state_tensors() if averager.outer is not None else list(averager.refs or [])


@pytest.mark.parametrize("backend", ["device", "host"])
@pytest.mark.parametrize("kind", STATEFUL)
def test_a_joiner_takes_what_the_rounds_keep_alike_but_no_feedback(
    group: SurvivingGroup, backend: str, kind: str
) -> None:
    member, member_model = averager(group, backend, kind, seed=0)
    joiner, joiner_model = averager(group, backend, kind, seed=1)  # a fresh process of another start
    for window in (1, 2):
        train(member_model, window)
        run_round(member)
    assert not same(replicated(joiner), replicated(member))
    sent: list[Tensor] = []
    member.share(sent.extend)
    joiner.share(lambda tensors: [t.copy_(s) for t, s in zip(tensors, sent, strict=True)])
    assert same(model_state(joiner_model), model_state(member_model))
    assert same(replicated(joiner), replicated(member))
    # A wire's feedback is what this rank's own rounds left out: a joiner taking it would send it again.
    feedback = member.reducer.feedback_state().values()
    assert not any(s is f for s in sent for f in feedback)


@pytest.mark.parametrize("sent_as", [None, torch.bfloat16])
def test_sync_buckets_waited_for_by_survive_cross_the_wire_as_the_wire_says(
    group: SurvivingGroup, sent_as: torch.dtype | None
) -> None:
    model = nn.Linear(4, 1, bias=False)
    process_group = group.membership.process_group()
    ddp = DistributedDataParallel(model, process_group=process_group)
    ddp.register_comm_hook(
        SettledBuckets(process_group, group.membership.settle, sent_as), settled_gradient_hook
    )
    inputs = torch.full((1, 4), 1.0 + 2**-10)  # the gradient of w.x is x: not a bf16 number
    ddp(inputs).sum().backward()
    assert model.weight.grad is not None
    expected = inputs if sent_as is None else inputs.to(sent_as).float()
    assert torch.equal(model.weight.grad, expected)
