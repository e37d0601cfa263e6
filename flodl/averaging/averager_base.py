"""What both averaging backends share (`device_averager.py`, `host_averager.py`; the round's shape is in
`consensus.py`): the flat parameters, the reducer over the group, the outer optimizer's and the wire's
state, the shared reference parameters, and the round's outcome."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flodl.averaging.flat import flatten_float32_buffers, flatten_parameters, state_digest
from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.averaging.reduce_group import ReduceGroup
from flodl.averaging.reducer import Reducer
from flodl.averaging.shards import ShardCopies, gathered_units, sharded_parameters
from flodl.averaging.wire import Wire


@dataclass(frozen=True)
class RoundOutcome:
    steps: int
    # Σ over ranks of the steps since the last reduce (the run's step clock advances by this).
    total_steps: int
    # No rank moved since the last reduce: nothing was averaged, everyone kept its state.
    skipped: bool
    # ‖own - consensus‖ / ‖consensus‖ (0 when the rank kept no pre-reduce copy or the round was skipped).
    divergence: float
    # Time the round held up this rank's training thread.
    blocked_ms: float
    payload_bytes: int = 0
    # From the round's start to its consensus on this rank, whether training waited for it or not (the
    # device backend's round is all on the training thread: its blocked time).
    comm_ms: float = 0.0


class AveragerBase:
    def __init__(
        self,
        model: nn.Module,
        gamma: float,
        wire: Wire,
        outer: OuterSettings | None,
        group: ReduceGroup,
        shard_group: int = 1,
    ) -> None:
        """`shard_group` > 1: the model's parameters are the rank's shards of its group's (shards.py) and
        `group` the ranks holding the same shard, each standing for its group's `shard_group` ranks, which
        took as many steps (the step clock counts every rank's)."""
        self.shards = (
            ShardCopies(sharded_parameters(model), gathered_units(model)) if shard_group > 1 else None
        )
        self.shard_group = shard_group
        self.params = self.shards.groups if self.shards is not None else flatten_parameters(model)
        self.buffers = flatten_float32_buffers(model)
        self.group = group
        # The backends make these once the shared start is in place (their global starts from it).
        self.outer: OuterOptimizer | None = None
        self.refs: list[Tensor] | None = None
        self.share(group.share_before_start)
        process_group, backend = group.collective()
        self.reducer = Reducer(gamma, wire, process_group, backend, group.settle)
        self.reducer.capture_after = group.capture_after
        self.outer_settings = outer
        self.outcome: RoundOutcome | None = None

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's momentum (its global parameters are the consensus a checkpoint holds; a
        sharded model's momentum is written in shards: `outer_momentum`) and a quantized wire's error
        feedback."""
        state: dict[str, Any] = {"wire_feedback": self.reducer.feedback_state()}
        if self.outer is not None and self.shards is None:
            state["outer"] = self.outer.optimizer.state_dict()
        return state

    def outer_momentum(self) -> list[Tensor]:
        """The outer optimizer's momentum as a tensor per trainable parameter, shaped as the rank holds it
        (its shard, sharded), in the flat buffers' order (flat.by_dtype): views into the momentum, which a
        checkpoint of shards writes and its resume fills in place. None without an outer optimizer's
        momentum."""
        if self.outer is None:
            return []
        momenta = self.outer.state_tensors()[len(self.outer.global_params) :]
        views = []
        for momentum, group in zip(momenta, self.params, strict=False):  # momentum=0: none
            offset = 0
            for view in group.views:
                views.append(momentum[offset : offset + view.numel()].view_as(view))
                offset += view.numel()
        return views

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is not None and "outer" in state:
            self.outer.load_state_dict(state["outer"])
        tensors = self._reduced_tensors()
        feedback = state.get("wire_feedback", {})
        if self.shards is not None:  # a part of other groups holds another shard's: this one starts at zero
            feedback = {i: f for i, f in feedback.items() if i < len(tensors) and f.shape == tensors[i].shape}
        self.reducer.load_feedback_state(feedback, tensors)

    def _reduced_tensors(self) -> list[Tensor]:
        """The tensors the reducer is handed, in its order (the device's flat buffers, or their host copy)."""
        return self._flat_params()

    @torch.no_grad()
    def discard_own(self) -> None:
        """Zero this rank's parameters before a round it joins with no weight (its window went non-finite):
        a NaN times a zero weight would still poison the sum."""
        for group in self.params:
            group.buffer.zero_()
        self._push()

    @property
    def resets_inner(self) -> bool:
        """DiLoCo: the inner optimizer's state is reset after each adopted round."""
        return self.outer_settings is not None and self.outer_settings.resets_inner

    def _state_tensors(self) -> list[Tensor]:
        """What makes two ranks' models the same: the flat parameters and f32 buffers."""
        return self._flat_params() + ([self.buffers.buffer] if self.buffers is not None else [])

    def _replicated_tensors(self) -> list[Tensor]:
        """What the rounds keep alike on every rank: the outer optimizer's global parameters and momentum,
        or a delta wire's reference (the last consensus)."""
        if self.outer is not None:
            return self.outer.state_tensors()
        return self.refs or []

    def _averaging_tensors(self) -> list[Tensor]:
        """What a round changes beside the rank's state: the replicated tensors and this rank's own wire
        feedback."""
        return self._replicated_tensors() + self.reducer.feedback_tensors(self._reduced_tensors())

    def _keep_round_start(self) -> None:
        """A round begins: what a cut of it goes back to (the averaging tensors first, then the state)."""
        self.group.keep_round_start(self._averaging_tensors() + self._state_tensors())

    @torch.no_grad()
    def share(self, send: Callable[[list[Tensor]], None]) -> None:
        """Make every rank hold the same state through `send` (a broadcast from one rank), and what the rounds
        keep alike (a wire's feedback is each rank's own). Local SGD never runs DDP's initial broadcast; a
        rank joining a survive run receives the consensus and the outer optimizer's state this way."""
        self._pull()
        send(self._state_tensors() + self._replicated_tensors())
        self._push()

    @torch.no_grad()
    def restore_pre_round(self) -> None:
        """A round this rank finished was cut elsewhere: back to the state it began from."""
        self.group.back_to_round_start(self._averaging_tensors() + self._state_tensors())
        self._push()

    @torch.no_grad()
    def restore_averaging(self) -> None:
        """A round was cut whose result this rank keeps in its own state (an EASGD blend), or which never
        touched it (the host backend's): the averaging tensors go back to its start, as every member's do,
        for the round's second run."""
        averaging = self._averaging_tensors()
        if averaging:  # plain averaging over the float32 wire keeps none
            self.group.back_to_round_start(averaging)

    @torch.no_grad()
    def state_digest(self) -> str:
        """The fingerprint of the rank's state (see flat.state_digest)."""
        self._pull()
        return state_digest(self._state_tensors())

    def regroup(self) -> None:
        """Average over the group's newly formed members from the next round on."""
        self.reducer.set_group(*self.group.collective())

    def _pull(self) -> None:
        """A sharded model's shards into the flat buffers, before a round reads them."""
        if self.shards is not None:
            self.shards.pull()

    def _push(self) -> None:
        """The flat buffers into a sharded model's shards, after a round wrote them."""
        if self.shards is not None:
            self.shards.push()

    def _flat_params(self) -> list[Tensor]:
        return [g.buffer for g in self.params]

    def release(self) -> None:
        """Free what the rounds hold on the device for the process group (before it is destroyed)."""
        self.reducer.release()


def make_refs(outer: OuterOptimizer | None, wire: Wire, tensors: list[Tensor]) -> list[Tensor] | None:
    """The shared reference parameters: the outer optimizer's global, or the last consensus for a delta
    wire."""
    if outer is not None:
        return outer.global_params
    return [t.detach().clone() for t in tensors] if wire.needs_reference else None


def after_reduce(outer: OuterOptimizer | None, refs: list[Tensor] | None, consensus: list[Tensor]) -> None:
    """Step the outer optimizer (new global into `consensus`), or remember the consensus as reference."""
    if outer is not None:
        outer.step(consensus)
    elif refs is not None:
        for ref, cons in zip(refs, consensus, strict=True):
            ref.copy_(cons)
