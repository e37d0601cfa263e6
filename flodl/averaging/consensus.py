"""Averaging backends for local SGD: how a round runs once the coordinator says when.

The reduce itself is `reducer.py`'s (the mechanism: docs/architecture.md, "Local SGD reduce"). This module
is where callers import the backends from; each lives in its own (`device_averager.py`, `host_averager.py`,
their shared part in `averager_base.py`, who they reduce with in `reduce_group.py`), and each is handed the
`Wire` the assembly chose (`wire.py`).

Both backends own the model's flat parameter storage (see `flat.py`) and expose one round as
`begin(steps)` → `ready()` → `finish()` → `adopt(alpha, evaluate)`:

- `DeviceAverager` (backend=nccl; gloo without a GPU): `begin` queues the reduce on the device, in place
  (a small model's round replayed as a CUDA graph, see `replayed.py`); `finish` reads what it measured.
- `HostAverager` (backend=cpu): `begin` snapshots the parameters into host buffers and reduces them over a
  gloo group on a background thread; training goes on meanwhile (async, or overlapped rounds) and the
  consensus is adopted at a later step boundary. Steps taken during the round keep their weight for the
  next one; an overlapped round keeps them in the parameters too (`params += consensus - snapshot`).

After the reduce, an optional outer optimizer steps the global parameters (`outer.py`); `adopt` evaluates
the consensus if asked, then overwrites the rank's parameters or blends them (EASGD:
`W += alpha (avg - W)`). Float32 buffers are always overwritten. Optimizer state is never averaged.
"""

from flodl.averaging.averager_base import RoundOutcome
from flodl.averaging.device_averager import DeviceAverager
from flodl.averaging.host_averager import HostAverager
from flodl.averaging.reduce_group import WORLD, ReduceGroup, WorldGroup

__all__ = ["WORLD", "DeviceAverager", "HostAverager", "ReduceGroup", "RoundOutcome", "WorldGroup"]
