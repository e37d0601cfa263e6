"""The group a rank trains and averages with, chosen once by the assembly: `FixedGroup` (fault_tolerance=none:
the world, where a failed collective ends the run) or `SurvivingGroup` (survive: the members, formed again at
each cut or admission). Workers and averagers take the group and never ask which it is.

The coordinator decides every membership change and says it with a `Regroup`; a surviving group only obeys:
it frees a collective the change cut, lets the worker leave what it was doing (`GroupMember.let_go`), forms
the new group, has the members' state settled on it (`GroupMember.settle`), and retries while members die
under the forming. A restarted rank first waits to be admitted and receives the members' state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.consensus import ReduceGroup, WorldGroup
from flodl.links.membership import AveragingGroup
from flodl.links.messages import Joined, Message, Regroup, Regrouped, Shutdown
from flodl.links.transport import INBOX_WAIT_S, InboxReader
from flodl.logs import one_line
from flodl.metrics import run_clock
from flodl.worker.group_evals import GroupEvals

log = logging.getLogger("flodl")


class GroupMember(Protocol):
    """What a worker answers as its group changes (only a surviving group asks)."""

    rank: int

    def report(self, message: Message) -> None: ...

    def let_go(self, change: Regroup) -> None:
        """Before the group `change` names is formed: leave what the change cut (a round, DDP's buckets)."""
        ...

    def settle(self, group: AveragingGroup, change: Regroup | None) -> None:
        """On a newly formed group (`change`'s; None: the first, of every rank): make the members' state
        agree."""
        ...

    def regrouped(self, change: Regroup, formed: Regrouped) -> None:
        """The group `change` names is formed and settled: say so (`formed`)."""
        ...


class RankGroup(ReduceGroup, Protocol):
    """The group a rank trains and averages with, as workers see it (averagers see its `ReduceGroup` part)."""

    @property
    def generation(self) -> int:
        """The group's number: what reports of it carry (0 at the start, one more at each change)."""
        ...

    @property
    def size(self) -> int: ...

    @property
    def index(self) -> int:
        """This rank's place among the members (its share of an eval; 0: the first member)."""
        ...

    @property
    def joining(self) -> bool:
        """A restarted rank, which joins a running group instead of starting with every rank."""
        ...

    @property
    def aborted(self) -> bool:
        """A change was announced under the current group: its collectives hold no consensus."""
        ...

    def start(self, member: GroupMember, before_start: Callable[[], None]) -> None:
        """The rank's start, before its first message (`before_start`: a fault injected there)."""
        ...

    def failed(self, what: str, cause: BaseException | None, member: GroupMember) -> None:
        """Something of the group `failed` (a collective, its step or round): raise `cause`, or carry out the
        change that follows."""
        ...

    def change(self, message: Regroup, member: GroupMember) -> None:
        """The coordinator's `Regroup`, as the worker's loop reads it."""
        ...

    def say_state(self, state: Callable[[], str]) -> None:
        """Log `state()`, this rank's state fingerprinted where the members must hold the same."""
        ...

    def round_stands(self, finished: bool) -> bool:
        """Before a round's eval, which a sharded group's members run together (and under async before every
        blend), and as such a round is cut: whether the round, `finished` here or not, stands for every
        member of the rank's sharded group."""
        ...


class FixedGroup(WorldGroup):
    """The world, fixed for the whole run (fault_tolerance=none): DDP, or the averager as it is built, starts
    every rank from rank 0's state; a failed collective raises and ends the run."""

    generation = 0
    joining = False
    aborted = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        super().__init__(process_group, timeout_s)
        self.rank, self.world_size = rank, world_size

    @property
    def size(self) -> int:
        return self.world_size

    @property
    def index(self) -> int:
        return self.rank

    def start(self, member: GroupMember, before_start: Callable[[], None]) -> None:
        """Nothing: the world was formed before the worker, and its state shared as it was built."""

    def failed(self, what: str, cause: BaseException | None, member: GroupMember) -> None:
        raise cause if cause is not None else RuntimeError(f"rank {self.rank}: {what}")

    def change(self, message: Regroup, member: GroupMember) -> None:
        raise RuntimeError(f"rank {self.rank}: a Regroup without fault_tolerance=survive: {message!r}")

    def say_state(self, state: Callable[[], str]) -> None:
        """Nothing: DDP and the exact rounds keep the world equal, and nothing changes it."""

    def round_stands(self, finished: bool) -> bool:
        """As it went here: a round that failed anywhere failed the run."""
        return finished


class SurvivingGroup:
    """fault_tolerance=survive: the members' `AveragingGroup`, formed by the workers (generation 0 with every
    rank the job starts with; a restart or a new rank waits for its admission) and again at each `Regroup`.

    With sharded groups (`shard_group` > 1) a rank averages its shard with the members holding the same
    shard index: its `AveragingGroup` is theirs (on a store prefix of that index), while its place and the
    group's size (an eval's shares, the first member) count every member."""

    # A captured round could not follow the group to its next communicator.
    capture_after: int | None = None

    def __init__(
        self,
        membership: AveragingGroup,
        reader: InboxReader,
        world_size: int,
        incarnation: int,
        joining: bool,
        wait_s: float,
        shard_group: int = 1,
        evals: GroupEvals | None = None,
    ) -> None:
        """`world_size`: the ranks that form generation 0; `incarnation`: how often this rank's seat was
        taken before; `joining`: a restart, or a rank in a seat past the start's, which joins a running
        group; `shard_group`: ranks per sharded group (1: full replicas), whose members vote before an eval
        (`evals`)."""
        self.membership = membership
        self.shard_group = shard_group
        self.evals = evals
        # Every member of the group formed last (with sharded groups, more than `membership` holds).
        self.members: list[int] = []
        self.reader = reader
        self.rank = membership.rank
        self.world_size = world_size
        self.incarnation = incarnation
        self._joining = joining
        # How long a rank whose group failed waits for the coordinator's Regroup.
        self.wait_s = wait_s
        self.timeout_s = membership.timeout.total_seconds()
        # The rank's state as the round in flight began (a cut round goes back to it).
        self._round_start: list[Tensor] = []
        reader.on_arrival = self._release_if_cut

    # --- what workers and averagers read ---------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        return self.members.index(self.rank)

    @property
    def joining(self) -> bool:
        return self._joining

    @property
    def aborted(self) -> bool:
        return self.membership.aborted.is_set()

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        return self.membership.group, self.membership.backend

    def settle(self, work: dist.Work) -> None:
        self.membership.settle(work)

    def share_before_start(self, tensors: list[Tensor]) -> None:
        """Nothing yet: the members share once their first group is formed (`start`)."""

    def keep_round_start(self, tensors: list[Tensor]) -> None:
        if len(self._round_start) != len(tensors):
            self._round_start = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self._round_start, tensors)

    def back_to_round_start(self, tensors: list[Tensor]) -> None:
        """`tensors`: what keep_round_start kept, or its first ones (an averager's own state stays)."""
        assert self._round_start, "no round began"
        torch._foreach_copy_(tensors, self._round_start[: len(tensors)])

    def say_state(self, state: Callable[[], str]) -> None:
        """The members compare these lines after each change and at the end (they hold the same state, bit
        for bit). A restart the run ended before admitting holds a fresh model, no member's: it says none."""
        if self.membership.generation >= 0:
            log.info("rank %d: state after %s", self.rank, state())

    def round_stands(self, finished: bool) -> bool:
        """Full replicas evaluate apart; a sharded group's members agree (flodl/worker/group_evals.py)."""
        return finished if self.evals is None else self.evals.stands(finished, self.generation)

    # --- the changes -------------------------------------------------------------------------------------

    def start(self, member: GroupMember, before_start: Callable[[], None]) -> None:
        """An original member forms generation 0 with every rank and settles the members' state on it (each
        starts from rank 0's); a rank that dies meanwhile is cut like any other. A restarted rank says it is
        ready (Joined, with its start-up time) and waits to be admitted with the members' state."""
        if self.joining:
            startup_s = time.time() - run_clock.rank_started_at()
            member.report(Joined(self.rank, self.incarnation, startup_s))
            admission = self.await_admission()
            if admission is not None:  # else the run ended first
                self._regroup(admission, member)
            return
        try:
            before_start()
            self._form(0, list(range(self.world_size)))
            member.settle(self.membership, None)
        except Exception as err:
            self.failed("the first averaging group failed", err, member)

    def failed(self, what: str, cause: BaseException | None, member: GroupMember) -> None:
        """Wait for the coordinator's word on who is still in, and form that group."""
        message = self.await_regroup(what, cause)
        if message is not None:  # else the run ended first
            self._regroup(message, member)

    def change(self, message: Regroup, member: GroupMember) -> None:
        """A Regroup read between steps or rounds: formed unless this group is it already, or a newer one was
        announced since (that one comes next)."""
        if message.generation > self.generation and not self.superseded(message):
            self._regroup(message, member)

    def _regroup(self, message: Regroup, member: GroupMember) -> None:
        """Let go of the old group, form the one `message` names and settle the members' state on it; while a
        member dies under the forming, wait for the next Regroup and form that one."""
        while True:
            started = time.perf_counter()
            member.let_go(message)
            release_ms = (time.perf_counter() - started) * 1000
            try:
                form_s = self._form(message.generation, message.members, patient=message.in_order)
                member.settle(self.membership, message)
            except Exception as err:  # a member died while the group formed: the coordinator cuts it next
                retry = self.await_regroup(f"averaging group {message.generation} could not be formed", err)
                if retry is None:  # the run ended first
                    return
                message = retry
                continue
            log.info(
                "rank %d: averaging group %d is %s%s (formed in %.0f ms)",
                self.rank,
                message.generation,
                list(message.members),
                f", admitting {message.joining}" if message.joining else "",
                form_s * 1000,
            )
            member.regrouped(message, Regrouped(self.rank, message.generation, release_ms, form_s * 1000))
            return

    def _form(self, generation: int, members: list[int], patient: bool = False) -> float:
        """Form group `generation` of `members`: this rank's averaging group is those holding its shard."""
        k = self.shard_group
        form_s = self.membership.form(generation, [m for m in members if m % k == self.rank % k], patient)
        self.members = sorted(members)
        return form_s

    def _release_if_cut(self, message: Message) -> None:
        """On the inbox's thread: a Regroup frees any collective the loop is blocked in (a round the change
        cut, or the forming of a group a member left); the loop forms the next group in any case. An in-order
        one (sync's admission) waits its turn: it only makes the forming of an older group pointless. A
        Shutdown ends any forming still waiting for members."""
        if isinstance(message, Regroup):
            self.membership.announce(message.generation)
            if not message.in_order:
                self.membership.abort()
        elif isinstance(message, Shutdown):  # a restarted rank still waiting for its group stops waiting
            self.membership.abandoned.set()

    def superseded(self, message: Regroup) -> bool:
        """A newer membership was announced since `message` (which is then not formed)."""
        return message.generation < self.membership.announced

    # --- waiting for the coordinator -------------------------------------------------------------------

    def await_regroup(self, failed: str, cause: BaseException | None) -> Regroup | None:
        """Something of the group `failed` (a round's collective, the forming of a group): wait for the
        coordinator's word on who is still in."""
        why = f" ({type(cause).__name__}: {_first_line(cause)})" if cause is not None else ""
        log.warning("rank %d: %s%s; waiting for the new group", self.rank, failed, why)
        return self._await(
            lambda m: isinstance(m, Regroup), f"a Regroup ({failed})", limit_s=self.wait_s, cause=cause
        )

    def await_admission(self) -> Regroup | None:
        """A restarted rank: wait until the coordinator admits it at a round boundary. Whatever else is in
        its inbox was meant for its previous incarnation."""
        return self._await(
            lambda m: isinstance(m, Regroup) and self.rank in m.joining,
            "admission into the running group",
            keep_others=False,
            limit_s=None,
        )

    def _await(
        self,
        wanted: Callable[[Message], bool],
        what: str,
        keep_others: bool = True,
        limit_s: float | None = None,
        cause: BaseException | None = None,
    ) -> Regroup | None:
        """The first message `wanted` accepts (others are given back to the loop, or dropped; a Regroup a
        newer one overtook is dropped); None when a Shutdown came first (it is given back too); past
        `limit_s` (None: no limit), an error raised from `cause` (no change came: the failure was no
        member's death)."""
        deadline = None if limit_s is None else time.perf_counter() + limit_s
        others: list[Message] = []
        try:
            while deadline is None or time.perf_counter() < deadline:
                message = self.reader.next_message(INBOX_WAIT_S)
                if message is None:
                    continue
                if isinstance(message, Shutdown):  # the run ended meanwhile: the loop ends on it
                    others.append(message)
                    return None
                if isinstance(message, Regroup) and self.superseded(message):
                    continue
                if wanted(message):
                    assert isinstance(message, Regroup)
                    return message
                if keep_others:
                    others.append(message)
        finally:
            self.reader.hold(others)  # a Shutdown is kept even when the rest is not
        why = f"; so the failure was no member's death: {type(cause).__name__}: {cause}" if cause else ""
        raise RuntimeError(
            f"rank {self.rank}: no word from the coordinator within {limit_s} s while waiting for {what}{why}"
        ) from cause


def _first_line(err: BaseException) -> str:
    """The error's first line, at most 200 characters, cut at a word."""
    text = str(err).strip()
    return one_line(text.splitlines()[0], 200) if text else ""
