"""The averaging group under fault_tolerance=survive: the ranks that are in, as a process group that can be
let go of and formed again when one dies or comes back.

Each membership gets a process group of its own, built directly on a fresh prefix of the run's store
(`averaging/<generation>/`): nothing of it derives from the world the dead rank was part of (a group split
from that world's communicator fails once a member is gone). A collective pending with a dead peer is
released by `abort` (NCCL: the communicator's abort, from any thread). gloo has no abort that wakes a
pending operation, and a survivor can wait on a live peer that already left the collective (its own part
failed on the dead rank's closed socket); so on gloo every collective of the group is waited for in short
slices (`settle`) and given up once the group is aborted, and the abandoned group is kept until its
operation ends (at its timeout: dropping it earlier would block in its destructor).

Forming waits until every member said it is ready on the store before the backend is built, and gives up as
soon as a newer generation is announced: a member that died, or a change that overtook this one, then costs
the others no timeout.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import PrefixStore, Store

from flodl.links.state_bytes import state_from_bytes, state_to_bytes

# How often forming looks at the store for members not ready yet: often at first (a change in progress), then
# gently (a sync admission may wait out the members' epochs).
_POLL_S = 0.005
_PATIENT_POLL_S = 0.1
# How long a gloo collective is waited for before the waiter looks whether the group was aborted.
_SETTLE_SLICE = timedelta(seconds=0.1)


class Superseded(RuntimeError):
    """A newer membership was announced while this one formed: form that one instead."""


class GroupAborted(RuntimeError):
    """The coordinator cut the group while this rank waited for one of its collectives."""


def cut_key(rank: int) -> str:
    """The store key (at the store's root) through which the coordinator cuts `rank` and the self-launch
    supervisor learns of it; its value is the incarnation cut."""
    return f"flodl/cut/{rank}"


# The other way: the supervisor, which reaps a rank's exit the moment it happens, tells the coordinator
# (without waiting out a heartbeat timeout). A counter says how many exits were posted, so that the
# coordinator reads one key per look; each exit is a JSON record under its own key.
_EXITS = "flodl/exits"


def post_exit(store: Store, rank: int, incarnation: int, cause: str) -> None:
    """The supervisor saw incarnation `incarnation` of `rank` end (`cause`: its exit code or signal)."""
    record = {"rank": rank, "incarnation": incarnation, "cause": cause, "at": time.time()}
    number = store.add(_EXITS, 1)
    store.set(f"{_EXITS}/{number}", json.dumps(record))


class ExitReader:
    """The coordinator's side: the exits posted since it last looked (one store read when there are none)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.read = 0

    def new(self) -> list[dict[str, Any]]:
        posted = self.store.add(_EXITS, 0)
        found = []
        while self.read < posted:
            self.read += 1
            found.append(json.loads(self.store.get(f"{_EXITS}/{self.read}")))
        return found


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
        # The newest generation the coordinator announced (any thread): forming an older one is pointless.
        self.announced = -1
        # Set when the run ends (any thread): no group is formed any more.
        self.abandoned = threading.Event()
        # gloo: groups given up with an operation still pending, kept until it ends (see the module's doc).
        self._given_up: list[tuple[dist.ProcessGroup, dist.Work]] = []

    @property
    def index(self) -> int:
        """This rank's place in the group (its rank within the collective)."""
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def form(self, generation: int, members: list[int], patient: bool = False) -> float:
        """Form the group of `members` (every member calls this with the same arguments); seconds taken.
        The previous generation's group is dropped (it was aborted, or its peers are gone). `patient`: wait
        for the members however long they take (a sync admission: they come once their planned epochs are
        trained); otherwise at most the group's timeout."""
        if self.rank not in members:
            raise RuntimeError(f"rank {self.rank} is not in the averaging group {members}")
        started = time.perf_counter()
        ordered = tuple(sorted(members))
        store = PrefixStore(f"averaging/{generation}/", self.store)
        self._await_members(store, generation, ordered, patient)
        index = ordered.index(self.rank)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            backend: dist._Backend = dist.ProcessGroupNCCL(store, index, len(ordered), options)
        else:
            backend = dist.ProcessGroupGloo(store, index, len(ordered), self.timeout)
        # torch's stubs type it as a Backend only: it serves every collective of a ProcessGroup that flodl
        # calls, and torch's functions (dist.all_reduce) take it as a group.
        group = cast(dist.ProcessGroup, backend)
        with self._lock:
            self._given_up = [(g, w) for g, w in self._given_up if not w.is_completed()]
            self.group, self.generation, self.members = group, generation, ordered
            if self.announced <= generation:  # else a newer change arrived meanwhile: this group is doomed
                self.aborted.clear()
        return time.perf_counter() - started

    def _await_members(self, store: Store, generation: int, members: tuple[int, ...], patient: bool) -> None:
        store.set(f"ready/{self.rank}", "1")
        started = time.perf_counter()
        deadline = started + self.timeout.total_seconds()
        waiting = list(members)
        while waiting:
            waiting = [r for r in waiting if not store.check([f"ready/{r}"])]
            if self.announced > generation:
                raise Superseded(f"averaging group {generation} was overtaken by group {self.announced}")
            if self.abandoned.is_set():
                raise Superseded(f"averaging group {generation}: the run ended while it formed")
            if waiting and not patient and time.perf_counter() > deadline:
                raise TimeoutError(
                    f"averaging group {generation}: ranks {waiting} were not ready within "
                    f"{self.timeout.total_seconds():g} s"
                )
            if waiting:
                time.sleep(_POLL_S if time.perf_counter() - started < 1.0 else _PATIENT_POLL_S)

    def announce(self, generation: int) -> None:
        """The coordinator named group `generation` (callable from any thread)."""
        with self._lock:
            self.announced = max(self.announced, generation)

    def abort(self) -> None:
        """Release whatever collective is pending on this generation (callable from any thread)."""
        with self._lock:
            group = self.group
            self.aborted.set()
        if group is not None and self.backend == "nccl":
            group.abort()

    def settle(self, work: dist.Work) -> None:
        """Wait for `work`, a collective of this group. On gloo, in slices: once the group is aborted the
        wait ends with GroupAborted (its operation may be stuck on a member that left it; the group's
        timeout would end it much later)."""
        if self.backend == "nccl":
            work.wait()  # an abort fails it; on a GPU the current stream waits for it, not the host
            return
        while True:
            try:
                work.wait(_SETTLE_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # it ended, maybe just after the slice ran out: its own outcome
                    work.wait()  # returns, or raises what failed it (a closed socket, its timeout)
                    return
            if self.aborted.is_set():
                with self._lock:
                    if self.group is not None:
                        self._given_up.append((self.group, work))
                raise GroupAborted(
                    f"averaging group {self.generation} was cut while rank {self.rank} waited on a collective"
                )

    def broadcast_from(self, tensors: list[Tensor], member: int) -> None:
        """Every member gets the `tensors` of rank `member` (a joiner receives the consensus)."""
        self.broadcast(tensors, self.members.index(member))

    def broadcast(self, tensors: list[Tensor], source: int) -> None:
        """Every member gets the `tensors` of the member at index `source`."""
        assert self.group is not None, "broadcast before the group was formed"
        options = dist.BroadcastOptions()
        options.rootRank = source
        for tensor in tensors:
            self.settle(self.group.broadcast([tensor], options))

    @property
    def wire(self) -> torch.device:
        """Where the tensors a member sends of its own making live (its state's bytes, its position): the
        rank's GPU over NCCL, the host over gloo (backend=cpu), also for a rank on a GPU. A round's CUDA
        tensors go over gloo as they are (gloo copies them through the host)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def broadcast_state(self, state: Any, source: int) -> Any:
        """The member at index `source`'s `state` (plain data and tensors; the others pass None) on every
        member, its tensors on the CPU (state_from_bytes): serialized, then its size and its bytes broadcast
        from `wire`."""
        encoded = state_to_bytes(state) if self.index == source else None
        size = torch.tensor([0 if encoded is None else encoded.numel()], dtype=torch.int64, device=self.wire)
        self.broadcast([size], source)
        payload = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.wire)
        if encoded is not None:
            payload.copy_(encoded)
        self.broadcast([payload], source)
        return state if encoded is not None else state_from_bytes(payload)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every member's `tensor` (same shape on each), in member order."""
        assert self.group is not None, "all_gather before the group was formed"
        out = [torch.empty_like(tensor) for _ in self.members]
        self.settle(self.group.allgather([out], [tensor]))
        return out

    def process_group(self) -> dist.ProcessGroup:
        """The group as torch's `ProcessGroup` (what DDP takes), over the same backend."""
        assert self.group is not None, "process_group before the group was formed"
        kind = (
            dist.ProcessGroup.BackendType.NCCL
            if self.backend == "nccl"
            else dist.ProcessGroup.BackendType.GLOO
        )
        store = PrefixStore(f"averaging/{self.generation}/", self.store)
        wrapper = dist.ProcessGroup(store, self.index, self.size)
        wrapper._set_default_backend(kind)
        wrapper._register_backend(self.device, kind, cast(dist._Backend, self.group))  # what `form` built
        return wrapper
