"""The averaging group under fault_tolerance=survive: the ranks that are in, as a process group that can be
let go of and formed again when one dies or comes back.

Each membership gets a process group of its own, built directly on a fresh prefix of the run's store
(`averaging/<generation>/`): nothing of it derives from the world the dead rank was part of (a group split
from that world's communicator fails once a member is gone). A collective pending with a dead peer is
released by `abort` (NCCL: the communicator's abort, from any thread); gloo has no abort that wakes a
pending operation, so there the dead peer's closed sockets end it (the self-launch supervisor kills a cut
rank), and the group's timeout bounds it otherwise.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import PrefixStore, Store


def cut_key(rank: int) -> str:
    """The store key (at the store's root) through which the coordinator cuts `rank` and the self-launch
    supervisor learns of it; its value is the incarnation cut."""
    return f"flodl/cut/{rank}"


class AveragingGroup:
    def __init__(self, store: Store, backend: str, rank: int, device: torch.device, timeout_s: float) -> None:
        self.store = store
        self.backend = backend
        self.rank = rank
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.generation = -1
        self.members: tuple[int, ...] = ()
        self.group: dist.ProcessGroup | None = None
        self._lock = threading.Lock()
        # Set by `abort` (any thread): the collectives of this generation can no longer be trusted.
        self.aborted = threading.Event()

    @property
    def index(self) -> int:
        """This rank's place in the group (its rank within the collective)."""
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def form(self, generation: int, members: list[int]) -> float:
        """Form the group of `members` (every member calls this with the same arguments); seconds taken.
        The previous generation's group is dropped (it was aborted, or its peers are gone)."""
        if self.rank not in members:
            raise RuntimeError(f"rank {self.rank} is not in the averaging group {members}")
        started = time.perf_counter()
        ordered = tuple(sorted(members))
        store = PrefixStore(f"averaging/{generation}/", self.store)
        index = ordered.index(self.rank)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, index, len(ordered), options)
        else:
            group = dist.ProcessGroupGloo(store, index, len(ordered), self.timeout)
        with self._lock:
            self.group, self.generation, self.members = group, generation, ordered
            self.aborted.clear()
        return time.perf_counter() - started

    def abort(self) -> None:
        """Release whatever collective is pending on this generation (callable from any thread)."""
        with self._lock:
            group = self.group
            self.aborted.set()
        if group is not None and self.backend == "nccl":
            group.abort()

    def broadcast_from_first(self, tensors: list[Tensor]) -> None:
        """Every member gets the first member's `tensors` (a joiner receives the consensus)."""
        assert self.group is not None, "broadcast before the group was formed"
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()
