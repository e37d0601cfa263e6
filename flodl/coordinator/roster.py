"""Who is in the run, as its host sees it, in one place: the members, the generation of their averaging group,
restarted ranks waiting to be admitted and those admitted but not yet in a formed group.

The assembly picks the roster once. `Roster` is the fixed world of fault_tolerance=none: a rank lost (silent,
exiting, restarted) ends the run. `SurvivingRoster` (survive) cuts it instead: the cut is posted for the
self-launch supervisor and the rank's inbox emptied (flodl/coordinator/survivors.py), the driver hands its
work to the members left (`Driver.on_cut`), and a restart is taken back at the driver's next boundary. The
drivers plan for the members and send each change's `Regroup` through the roster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flodl.coordinator.driver import CoordinatorError, Driver
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.survivors import MembershipChange, SurviveSettings, post_cut, root_store
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.membership import ExitReader
from flodl.links.messages import Exiting, Joined, Regroup, Regrouped
from flodl.links.transport import Mailbox
from flodl.metrics.timeline import Timeline
from flodl.sharding.groups import ShardGroups

log = logging.getLogger("flodl")


class RankHung(CoordinatorError):
    """A rank went silent for longer than heartbeat_timeout_s."""


class TooFewRanks(CoordinatorError):
    """fault_tolerance=survive: fewer members than min_ranks are left (the run ended at a consensus)."""


class Roster:
    """The fixed world (fault_tolerance=none): every rank a member for the whole run; a lost one ends it."""

    # Set by the coordinator (`attach`): the policy's driver, how the run stops at its next consensus (the
    # last epoch trained), and the last checkpoint's path in words.
    driver: Driver
    stop_at_consensus: Callable[[str], int]
    last_checkpoint: Callable[[], str]

    def __init__(self, world_size: int, outbox: Mailbox, monitor: HeartbeatMonitor) -> None:
        self.outbox = outbox
        self.monitor = monitor
        # Every rank the run may hold (the fixed world's own): each has an inbox.
        self.seats = range(world_size)
        # The averaging group's number: one more at each change (what plans, rounds and reports carry).
        self.generation = 0
        self.members = set(range(world_size))
        # Restarted ranks waiting for the driver's next boundary; ranks admitted, not yet in a formed group.
        self.joiners: set[int] = set()
        self.unformed: set[int] = set()
        # Ranks admitted since the coordinator last looked (it watches their heartbeats from then on).
        self.admitted: list[int] = []
        # The newest group in which a round (sync: its first step) went through; -1: none yet.
        self.good_round_generation = -1
        # Why the run ends short of members (an error once model.pt is written).
        self.too_few: TooFewRanks | None = None

    def attach(
        self, driver: Driver, stop_at_consensus: Callable[[str], int], last_checkpoint: Callable[[], str]
    ) -> None:
        self.driver, self.stop_at_consensus, self.last_checkpoint = driver, stop_at_consensus, last_checkpoint

    def takes_stop_from(self, rank: int) -> bool:
        """Whether a stop signal `rank` got stops the run: a member's does; a process the run cut (left
        running past its cut, a network partition's) or one not admitted yet is no part of the run."""
        return rank in self.members

    @property
    def holders(self) -> set[int]:
        """The members that hold the run's latest model (not one admitted and still waiting for it)."""
        return self.members - self.unformed

    # --- what the drivers ask ---------------------------------------------------------------------------

    def admit_joiners(self) -> list[int]:
        """At a driver's boundary: the waiting ranks become members of a new group; they, sorted."""
        joining = sorted(self.joiners)
        self.generation += 1
        self.members |= self.joiners
        self.unformed |= self.joiners
        self.admitted.extend(joining)
        self.joiners = set()
        return joining

    def send_regroup(
        self,
        joining: list[int],
        cut_round: int | None = None,
        shares_state: bool = True,
        in_order: bool = False,
    ) -> None:
        """Tell every member the group is now the members, of this generation (see `Regroup`)."""
        order = Regroup(self.generation, sorted(self.members), joining, cut_round, shares_state, in_order)
        for member in sorted(self.members):
            self.outbox.send(member, order)

    def on_good_round(self, generation: int) -> None:
        """A round (sync: a new group's first step) went through in group `generation` (an older one's is
        late news)."""
        if generation == self.generation:
            self.good_round_generation = generation

    def on_regrouped(self, message: Regrouped) -> None:
        """A member formed a group: once it formed the newest, an admitted rank holds the members' state."""
        if message.generation == self.generation:
            self.unformed.discard(message.rank)

    # --- a rank lost or back: the fixed world ends the run ------------------------------------------------

    def on_silent(self, ranks: list[int], now: float) -> None:
        described = "; ".join(self.monitor.describe(rank, now) for rank in ranks)
        raise RankHung(
            f"{described} (heartbeat_timeout_s={self.monitor.timeout_s:g}); stopping the job. "
            f"Last checkpoint: {self.last_checkpoint()}"
        )

    def on_exiting(self, message: Exiting) -> None:
        why = f": {message.reason}" if message.reason else ""
        raise CoordinatorError(f"rank {message.rank} exited before the run finished{why}")

    def on_writer_exiting(self, message: Exiting) -> None:
        """The member asked to write the final model exited first."""
        raise CoordinatorError(
            f"rank {message.rank} exited before it wrote the final model: {message.reason}"
        )

    def on_joined(self, message: Joined) -> None:
        raise CoordinatorError(f"rank {message.rank} restarted, but fault_tolerance is not survive")

    def check_exits(self) -> None:
        """Nothing: no supervisor posts a rank's exit (a dead rank fails its peers' collectives)."""

    def follow_changes(self, run_ended: bool = False) -> None:
        """Nothing: the world never changes."""


class SurvivingRoster(Roster):
    """fault_tolerance=survive: a member silent past the heartbeat timeout, exiting, or back as a restart (its
    old process is then certainly gone) is cut; a restart, or a rank that joins the running job in a seat
    past the ones it started with, is admitted at the driver's next boundary; fewer than min_ranks members
    stop the run at its next consensus. Each change is timed (`MembershipChange`)."""

    def __init__(
        self,
        world_size: int,
        outbox: Mailbox,
        monitor: HeartbeatMonitor,
        ledger: EpochLedger,
        timeline: Timeline,
        settings: SurviveSettings,
    ) -> None:
        """`world_size`: the ranks the run starts with (its members); settings.capacity: its seats."""
        super().__init__(world_size, outbox, monitor)
        self.seats = range(settings.capacity)
        self.ledger = ledger
        self.timeline = timeline
        self.min_ranks = settings.min_ranks
        # Sharded groups (shard_group > 1): a rank's group leaves with it (its others hold no whole model),
        # and comes back whole: its restarts wait here until every one of them is ready (then joiners).
        self.groups = ShardGroups(settings.capacity, settings.shard_group)
        self.waiting: set[int] = set()
        # Each rank's current process (0: the first).
        self.incarnations: dict[int, int] = {}
        # The exits the self-launch supervisor posts (each one cut at once).
        self._exits = ExitReader(root_store(outbox.store))
        # Restarted ranks waiting for admission: when they said so, and their start-up time.
        self.joined: dict[int, tuple[float, float]] = {}
        # The changes being carried out, oldest first.
        self.changes: list[MembershipChange] = []

    def cut(self, rank: int, why: str, exited_at: float | None = None) -> None:
        """`rank` is gone: the others go on without it, or the run ends if too few are left. With sharded
        groups the other members of its group leave with it, in the same change: they cannot step without
        its shard (their processes are cut too, for the supervisor to end). `exited_at`: when its supervisor
        saw its process end (unix seconds), if that is how it is known."""
        leaving = [rank] + [mate for mate in self._group(rank) if mate != rank and mate in self.members]
        now = time.perf_counter()
        for gone in leaving:
            post_cut(self.outbox.store, gone, self.incarnations.get(gone, 0))
            timings = {"silent_s": self.monitor.silence_of(gone, now)}
            if exited_at is not None and gone == rank:  # how long after the death the cut came
                timings["after_exit_s"] = time.time() - exited_at
            self.ledger.membership_event("rank_cut", gone, timings)
            self.monitor.forget(gone)
            self.members.discard(gone)
            self.joiners.discard(gone)
            self.waiting.discard(gone)
            self.unformed.discard(gone)
        self.generation += 1
        self.driver.on_cut(leaving)
        members = sorted(self.members)
        if len(leaving) > 1:
            why = f"{why}; its group {sorted(leaving)} leaves with it"
        log.warning("rank %d is out (%s); the run goes on with ranks %s", rank, why, members)
        self.changes.append(MembershipChange("cut", rank, self.generation, members, why))
        if len(members) < self.min_ranks and self.too_few is None:
            self.too_few = TooFewRanks(
                f"only {len(members)} rank(s) left ({members}) after rank {rank} was cut ({why}); "
                f"min_ranks={self.min_ranks}: the run stops at its next consensus"
            )
            self.stop_at_consensus(str(self.too_few))

    def on_silent(self, ranks: list[int], now: float) -> None:
        """The host's process trains nothing: any rank may be cut."""
        for rank in ranks:
            if rank in self.members:  # else its group's cut took it out already
                self.cut(rank, f"no heartbeat for {self.monitor.silence_of(rank, now):.1f} s")

    def on_exiting(self, message: Exiting) -> None:
        if message.rank in self.members:
            self.cut(message.rank, f"exiting: {message.reason}" if message.reason else "exiting")

    def on_writer_exiting(self, message: Exiting) -> None:
        """Nothing yet: its exit, posted by its supervisor, or its silence cuts it, and the next holder is
        asked."""

    def on_joined(self, message: Joined) -> None:
        """A restarted rank (its old process is gone for certain) or a new one in a free seat: admitted at the
        driver's next boundary."""
        self.check_exits()  # its supervisor posted the old process's end before it started this one
        if message.rank in self.members:
            self.cut(message.rank, f"restarted as incarnation {message.incarnation}")
        self.incarnations[message.rank] = message.incarnation
        self.joined[message.rank] = (time.perf_counter(), message.startup_s)
        if self.too_few is None and not self.driver.done:
            log.info("rank %d (%s) waits to be admitted", message.rank, self._arrival(message))
            self.waiting.add(message.rank)
            group = set(self._group(message.rank))
            if group <= self.waiting:  # a sharded group is admitted whole, once every rank of it is ready
                self.joiners |= group
                self.waiting -= group

    def _group(self, rank: int) -> list[int]:
        """The ranks of `rank`'s sharded group (itself alone with full replicas)."""
        return self.groups.members(self.groups.group_of(rank))

    @staticmethod
    def _arrival(message: Joined) -> str:
        """How a joining rank came: restarted, or the first in a seat the run did not start with."""
        return "new, in a free seat" if message.incarnation == 0 else f"incarnation {message.incarnation}"

    def check_exits(self) -> None:
        """Cut at once the members whose process ended, as their supervisor saw it (an earlier incarnation's
        exit is old news: its restart is here already)."""
        for ended in self._exits.new():
            rank = ended["rank"]
            if ended["incarnation"] != self.incarnations.get(rank, 0):
                continue
            if rank in self.members:
                self.cut(rank, f"its process ended: {ended['cause']}", exited_at=ended["at"])
            elif self.groups.sharded and rank in self.waiting | self.joiners:
                self._restart_group(rank, ended["cause"])

    def _restart_group(self, rank: int, cause: str) -> None:
        """A restart of a sharded group ended before the group was admitted: its others, waiting, are cut too
        (their supervisor starts them again, in step with its own restart: a group's processes meet by their
        incarnation, flodl/job/assembly.py)."""
        for mate in self._group(rank):
            if mate in self.waiting | self.joiners:
                self.waiting.discard(mate)
                self.joiners.discard(mate)
                self.joined.pop(mate, None)
                if mate != rank:
                    post_cut(self.outbox.store, mate, self.incarnations.get(mate, 0))
        log.warning("rank %d ended before its group was admitted (%s): the group starts again", rank, cause)

    def on_regrouped(self, message: Regrouped) -> None:
        for change in self.changes:
            if change.generation == message.generation:
                change.on_formed(message.rank, message.release_ms, message.form_ms)
        super().on_regrouped(message)

    def follow_changes(self, run_ended: bool = False) -> None:
        """Admissions the driver made, first good rounds after a change, and each finished change's line
        (`run_ended`: every change's, finished or not)."""
        while self.admitted:
            rank = self.admitted[0]
            group = [r for r in self.admitted if r in self._group(rank)]  # a sharded group: one change
            self.admitted = [r for r in self.admitted if r not in group]
            joined = {r: self.joined.pop(r) for r in group}
            why = f"incarnation {self.incarnations[rank]}"
            if len(group) > 1:
                why = f"{why}; its group {group} with it"
            # A group is ready once its last rank is.
            startup_s = max(s for _, s in joined.values())
            change = MembershipChange(
                "admitted", rank, self.generation, sorted(self.members), why, startup_s=startup_s
            )
            change.waited_s = change.started - max(at for at, _ in joined.values())
            self.changes.append(change)
            for r, (joined_at, startup_s) in joined.items():
                self.monitor.watch(r, time.perf_counter())
                waited_s = change.started - joined_at
                self.ledger.membership_event(
                    "rank_admitted", r, {"startup_s": startup_s, "waited_s": waited_s}
                )
        for change in self.changes:
            change.on_good_round(self.good_round_generation)
        # In order; a change the next one overtook (its group never formed, or no round closed in it) too.
        while self.changes and (self.changes[0].done or len(self.changes) > 1 or run_ended):
            change = self.changes.pop(0)
            log.warning("%s", change.line(run_ended and len(self.changes) == 0))
            self.timeline.membership_changed(change.event())
