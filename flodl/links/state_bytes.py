"""A rank's state (tensors, numbers and strings in dicts, lists and tuples) as bytes for a collective, and
back. A peer's bytes are loaded with `weights_only=True`, said explicitly: torch releases this project
allows (before 2.6) default to unpickling anything, which would run whatever a peer's bytes ask for."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import Tensor


def state_to_bytes(state: Any) -> Tensor:
    """`state` serialized, as a uint8 tensor on the CPU."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def state_from_bytes(payload: Tensor) -> Any:
    """What `state_to_bytes` made of a state, its tensors on the CPU (as a checkpoint's are loaded: whoever
    takes them places them; an optimizer keeps its `step` counts there, and one on a GPU costs a device sync
    per parameter every step); refuses anything but plain data."""
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
