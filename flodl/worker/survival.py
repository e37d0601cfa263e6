"""A rank's side of fault_tolerance=survive: letting go of a round a dead member cut, forming the new
averaging group, and, for a restarted rank, waiting to be admitted and receiving the consensus.

The coordinator decides every membership change and says it with a `Regroup`; this module only obeys. A
round whose collective failed (a peer's socket closed, the group aborted) waits here for that Regroup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from flodl.logs import one_line
from flodl.wire.membership import AveragingGroup
from flodl.wire.messages import AverageNow, Joined, Message, Regroup, Regrouped, Shutdown
from flodl.wire.transport import InboxReader

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class FinishedRound:
    """The last round this rank finished, kept until the next window opens (until then a member's death can
    still cut it elsewhere, and an exact round is then redone by everyone)."""

    order: AverageNow
    # This rank's steps in it, every rank's, and the busy time the steps took.
    steps: int
    total_steps: int
    busy_s: float


class Survival:
    def __init__(
        self, membership: AveragingGroup, reader: InboxReader, incarnation: int, wait_s: float
    ) -> None:
        self.membership = membership
        self.reader = reader
        # How often this rank was started before (0: an original member; more: it joins a running group).
        self.incarnation = incarnation
        # How long a rank whose round failed waits for the coordinator's Regroup.
        self.wait_s = wait_s
        reader.on_arrival = self._release_if_cut

    @property
    def joining(self) -> bool:
        return self.incarnation > 0

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

    def await_regroup(self, rank: int, failed: str, cause: BaseException | None) -> Regroup | None:
        """Something of the group `failed` (a round's collective, the forming of a group): wait for the
        coordinator's word on who is still in."""
        why = f" ({type(cause).__name__}: {_first_line(cause)})" if cause is not None else ""
        log.warning("rank %d: %s%s; waiting for the new group", rank, failed, why)
        return self._await(
            rank, lambda m: isinstance(m, Regroup), f"a Regroup ({failed})", limit_s=self.wait_s, cause=cause
        )

    def await_admission(self, rank: int) -> Regroup | None:
        """A restarted rank: wait until the coordinator admits it at a round boundary. Whatever else is in
        its inbox was meant for its previous incarnation."""
        return self._await(
            rank,
            lambda m: isinstance(m, Regroup) and rank in m.joining,
            "admission into the running group",
            keep_others=False,
            limit_s=None,
        )

    def _await(
        self,
        rank: int,
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
                message = self.reader.next_message(0.5)
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
            f"rank {rank}: no word from the coordinator within {limit_s} s while waiting for {what}{why}"
        ) from cause

    def begin(
        self,
        rank: int,
        world_size: int,
        settle_first: Callable[[AveragingGroup], None],
        regroup: Callable[[Regroup], None],
        report: Callable[[Message], None],
        before_start: Callable[[], None],
    ) -> None:
        """A rank's start. An original member forms generation 0 with every rank and settles the members'
        state on it (`settle_first`: each starts from rank 0's); a rank that dies meanwhile is cut like any
        other, and the Regroup that follows goes to `regroup`. A restarted rank says it is ready (`report`:
        Joined, with its start-up time) and waits to be admitted with the members' state."""
        if self.joining:
            startup_s = time.time() - psutil.Process().create_time()
            report(Joined(rank, self.incarnation, startup_s))
            admission = self.await_admission(rank)
            if admission is not None:  # else the run ended first
                regroup(admission)
            return
        try:
            before_start()
            self.membership.form(0, list(range(world_size)))
            settle_first(self.membership)
        except Exception as err:
            failed = self.await_regroup(rank, "the first averaging group failed", err)
            if failed is not None:  # else the run ended first
                regroup(failed)

    def form(
        self, rank: int, message: Regroup, settle: Callable[[AveragingGroup], None], release_ms: float
    ) -> Regrouped:
        """Form the group `message` names, then `settle` the members' state over it (every member takes part:
        a joiner receives the first member's state)."""
        form_s = self.membership.form(message.generation, message.members, patient=message.in_order)
        settle(self.membership)
        log.info(
            "rank %d: averaging group %d is %s%s (formed in %.0f ms)",
            rank, message.generation, list(message.members),
            f", admitting {message.joining}" if message.joining else "", form_s * 1000,
        )  # fmt: skip
        return Regrouped(rank, message.generation, release_ms, form_s * 1000)


def _first_line(err: BaseException) -> str:
    """The error's first line, at most 200 characters, cut at a word."""
    text = str(err).strip()
    return one_line(text.splitlines()[0], 200) if text else ""
