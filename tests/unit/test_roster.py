"""Who is in the run, as its host sees it (flodl/coordinator/roster.py): the fixed world ends the run on a
lost rank; survive's roster cuts it, tells the driver, takes its restart back and stops the run when too few
are left."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore, PrefixStore

from flodl.coordinator.driver import CoordinatorError
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.roster import RankHung, Roster, SurvivingRoster
from flodl.coordinator.survivors import SurviveSettings, was_cut
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.membership import cut_key, post_exit
from flodl.links.messages import Exiting, Joined, Regrouped
from flodl.links.seats import take_seat
from flodl.links.transport import Mailbox
from flodl.metrics.timeline import Timeline


class Driver:
    """What the roster asks of a driver, recorded."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.cuts: list[tuple[int, int, set[int]]] = []
        # The ranks each cut took out together (a sharded group leaves whole).
        self.together: list[list[int]] = []
        self.done = False
        self.stops: list[str] = []

    def on_cut(self, ranks: list[int]) -> None:  # the roster's change is made before the driver hears of it
        self.together.append(ranks)
        self.cuts.extend((rank, self.roster.generation, set(self.roster.members)) for rank in ranks)

    def stop(self, reason: str) -> int:
        self.stops.append(reason)
        return 3


def fixed() -> Roster:
    monitor = HeartbeatMonitor(3, timeout_s=2.0, started=0.0)
    roster = Roster(3, Mailbox(HashStore(), "coordinator"), monitor)
    driver = Driver(roster)
    roster.attach(driver, driver.stop, lambda: "ckpt/epoch_2")  # type: ignore[arg-type]
    return roster


def surviving(
    min_ranks: int = 1, capacity: int = 3, world: int = 3, shard_group: int = 1
) -> tuple[SurvivingRoster, Driver, HashStore]:
    store = HashStore()
    monitor = HeartbeatMonitor(capacity, timeout_s=2.0, started=0.0, ignored=set(range(world, capacity)))
    ledger = EpochLedger(epochs=2, world_size=world, batches_per_epoch=4)
    settings = SurviveSettings(min_ranks, capacity, shard_group)
    roster = SurvivingRoster(
        world, Mailbox(store, "coordinator"), monitor, ledger, Timeline(capacity), settings
    )
    driver = Driver(roster)
    roster.attach(driver, driver.stop, lambda: "none")  # type: ignore[arg-type]
    return roster, driver, store


def test_the_fixed_world_ends_the_run_on_a_rank_lost_and_never_changes() -> None:
    roster = fixed()
    assert (roster.generation, roster.members, roster.holders) == (0, {0, 1, 2}, {0, 1, 2})
    with pytest.raises(
        RankHung, match=r"rank 1 stopped responding.*stopping the job. Last checkpoint: ckpt/epoch_2"
    ):
        roster.on_silent([1], now=5.0)
    with pytest.raises(CoordinatorError, match="rank 2 exited before the run finished: OOM"):
        roster.on_exiting(Exiting(2, "OOM"))
    with pytest.raises(CoordinatorError, match="rank 0 exited before it wrote the final model: OOM"):
        roster.on_writer_exiting(Exiting(0, "OOM"))
    with pytest.raises(CoordinatorError, match="restarted, but fault_tolerance is not survive"):
        roster.on_joined(Joined(1, incarnation=1, startup_s=2.0))
    roster.check_exits()
    roster.follow_changes(run_ended=True)
    assert roster.generation == 0


def test_a_cut_is_posted_for_the_supervisor_and_the_driver_hears_it_after_the_roster_changed() -> None:
    roster, driver, store = surviving()
    roster.on_exiting(Exiting(1, "OOM"))
    assert driver.cuts == [(1, 1, {0, 2})]
    assert store.get(cut_key(1)) == b"0"  # the incarnation the supervisor ends
    roster.on_exiting(Exiting(1, "OOM"))  # no longer a member: nothing more
    roster.on_silent([2], now=5.0)
    assert driver.cuts[-1] == (2, 2, {0})
    assert driver.stops == []


def test_with_sharded_groups_a_ranks_group_leaves_with_it_in_one_change() -> None:
    roster, driver, store = surviving(capacity=6, world=6, shard_group=2)
    roster.on_exiting(Exiting(3, "OOM"))  # groups [0, 1] [2, 3] [4, 5]
    assert driver.together == [[3, 2]] and roster.generation == 1
    assert driver.cuts == [(3, 1, {0, 1, 4, 5}), (2, 1, {0, 1, 4, 5})]
    assert store.get(cut_key(3)) == b"0" and store.get(cut_key(2)) == b"0"  # the supervisor ends both
    assert "its group [2, 3] leaves with it" in roster.changes[-1].why
    roster.on_silent([4, 5], now=5.0)  # both silent: the first's cut takes the group, the second is out
    assert driver.together[-1] == [4, 5] and roster.generation == 2 and roster.members == {0, 1}


def test_with_sharded_groups_a_group_is_admitted_whole_once_every_restart_of_it_waits() -> None:
    roster, _, _ = surviving(capacity=4, world=4, shard_group=2)
    roster.on_exiting(Exiting(2, "OOM"))  # [2, 3] leave
    roster.on_joined(Joined(2, incarnation=1, startup_s=1.0))
    assert (roster.joiners, roster.waiting) == (set(), {2})  # nothing to admit at a boundary yet
    roster.on_joined(Joined(3, incarnation=1, startup_s=3.0))
    assert (roster.joiners, roster.waiting) == ({2, 3}, set())
    assert roster.admit_joiners() == [2, 3]
    roster.follow_changes()
    admitted = [(c.rank, c.why, c.startup_s) for c in roster.changes if c.kind == "admitted"]
    assert admitted == [(2, "incarnation 1; its group [2, 3] with it", 3.0)]  # one change: the group's


def test_with_sharded_groups_a_restart_ending_before_its_admission_starts_its_group_again() -> None:
    roster, _, store = surviving(capacity=4, world=4, shard_group=2)
    roster.on_exiting(Exiting(3, "OOM"))
    roster.on_joined(Joined(2, incarnation=1, startup_s=1.0))
    roster.on_joined(Joined(3, incarnation=1, startup_s=1.0))
    post_exit(store, 3, 1, "signal SIGKILL")  # its supervisor saw restart 1 of rank 3 end
    roster.check_exits()
    assert (roster.joiners, roster.waiting, roster.members) == (set(), set(), {0, 1})
    assert store.get(cut_key(2)) == b"1"  # the other restart ends too: both start again, in step
    assert store.get(cut_key(3)) == b"0"  # rank 3's own was its old cut (its restart ended by itself)


def test_a_stop_signal_stops_the_run_only_from_a_member() -> None:
    # A rank the run cut while it lived (a partition) and that got SIGTERM afterwards stopped the whole run.
    roster, _, _ = surviving()
    assert all(roster.takes_stop_from(rank) for rank in (0, 1, 2))
    roster.on_silent([1], now=5.0)
    assert not roster.takes_stop_from(1) and roster.takes_stop_from(0)
    roster.on_joined(Joined(1, incarnation=1, startup_s=2.0))  # its restart, waiting for a boundary
    assert not roster.takes_stop_from(1)
    roster.admit_joiners()
    assert roster.takes_stop_from(1)
    assert all(fixed().takes_stop_from(rank) for rank in range(3))


def test_too_few_members_stop_the_run_at_its_next_consensus() -> None:
    roster, driver, _ = surviving(min_ranks=3)
    roster.on_silent([0], now=5.0)
    assert roster.too_few is not None and "min_ranks=3" in str(roster.too_few)
    assert driver.stops == [str(roster.too_few)]
    roster.on_joined(Joined(0, incarnation=1, startup_s=2.0))
    assert roster.joiners == set(), "a run that stops admits no one"


def test_a_restart_of_a_member_is_cut_then_admitted_and_holds_the_model_once_its_group_formed() -> None:
    roster, driver, _ = surviving()
    roster.on_joined(Joined(2, incarnation=1, startup_s=2.0))
    assert driver.cuts == [(2, 1, {0, 1})] and roster.joiners == {2}
    assert roster.admit_joiners() == [2]
    assert (roster.generation, roster.members, roster.holders) == (2, {0, 1, 2}, {0, 1})
    roster.follow_changes()  # the admission is timed from here; the cut before it was overtaken
    assert [(c.kind, c.rank) for c in roster.changes] == [("admitted", 2)]
    roster.on_regrouped(Regrouped(2, 1, 1.0, 2.0))  # an older group's: the joiner has not formed the newest
    assert roster.holders == {0, 1}
    for rank in (0, 1, 2):
        roster.on_regrouped(Regrouped(rank, 2, 1.0, 2.0))
    assert roster.holders == {0, 1, 2}
    roster.on_good_round(1)  # late: an older group
    assert roster.good_round_generation == -1
    roster.on_good_round(2)
    roster.follow_changes()
    assert roster.changes == [], "the admission is done: its group formed and a round went through"
    assert roster.monitor.silent(now=1.0) == []


def test_a_rank_new_in_a_seat_past_the_start_waits_and_is_admitted_and_its_cut_frees_the_seat() -> None:
    """launch.max_ranks=5 on 3 ranks: seats 3 and 4 hold no member until a joiner takes one (flodl-join); none
    is named silent meanwhile, and a Shutdown reaches every seat's inbox."""
    roster, driver, store = surviving(capacity=5)
    assert list(roster.seats) == [0, 1, 2, 3, 4] and roster.members == {0, 1, 2}
    assert roster.monitor.silent(now=60.0) == [0, 1, 2], "an empty seat is no silent rank"
    assert take_seat(store, 3, 5) == (3, 0)
    roster.on_joined(Joined(3, incarnation=0, startup_s=2.5))
    assert driver.cuts == [] and roster.joiners == {3}, "a new rank cuts nobody"
    assert roster.admit_joiners() == [3] and roster.members == {0, 1, 2, 3}
    roster.follow_changes()
    assert [(c.kind, c.rank, c.startup_s) for c in roster.changes] == [("admitted", 3, 2.5)]
    assert 3 not in roster.monitor.silent(now=roster.monitor.last_seen[3])
    roster.on_exiting(Exiting(3, "OOM"))
    assert driver.cuts[-1] == (3, 2, {0, 1, 2})
    assert take_seat(store, 3, 5) == (3, 1), "the cut freed seat 3: its next taking is numbered 1"
    assert take_seat(store, 3, 5) == (4, 0)
    assert take_seat(store, 3, 5) is None, "every seat taken"


def test_a_rank_cut_while_it_lived_learns_it_from_the_store_and_its_restart_does_not() -> None:
    """A rank no supervisor ends (started apart) asks was_cut as it waits for work, through its mailbox's
    prefix: its own process is cut once its silence cut it; its restart, the next incarnation, is not."""
    roster, _, store = surviving()
    mailbox = PrefixStore("flodl/run/", store)
    assert not was_cut(mailbox, 1, 0)
    roster.on_silent([1], now=5.0)
    assert was_cut(mailbox, 1, 0)
    assert not was_cut(mailbox, 1, 1) and not was_cut(mailbox, 0, 0)
