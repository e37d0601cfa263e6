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


def state_from_bytes(payload: Tensor, device: torch.device) -> Any:
    """What `state_to_bytes` made of a state, its tensors on `device`; refuses anything but plain data."""
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location=device, weights_only=True)
