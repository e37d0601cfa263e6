"""A rank's shard of its optimizer's state, as a peer holding the same shard index takes it over: survive by
groups admits a restarted group whose ranks each receive their shard's moments from the rank with their
shard index in a member group, as a full replica's joiner receives the whole optimizer state.

FSDP2's optimizer state is DTensors over the sending group's mesh; what travels is each one's local shard,
laid out again on the receiver's parameter (its own group's mesh, the same shard of the same shape).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with each DTensor as this rank's local shard (plain tensors to send)."""
    state = optimizer.state_dict()
    local = {
        index: {key: getattr(value, "to_local", lambda v=value: v)() for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    return {**state, "state": local}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what `local_optimizer_state` sent, each local shard laid out as this rank's parameter is (a
    DTensor over its group's mesh; a shard's scalars, Adam's `step`, stay as they are)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def laid_out(param: Tensor, value: Any) -> Any:
        if not isinstance(param, DTensor) or not isinstance(value, Tensor):
            return value
        if value.shape != param.to_local().shape:  # not a piece of the parameter (a step count)
            return value
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    entries = {
        int(index): {key: laid_out(params[int(index)], value) for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    optimizer.load_state_dict({**state, "state": entries})
