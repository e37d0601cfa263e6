"""The sync driver (flodl/coordinator/sync_driver.py): what is planned once the members agreed where a cut
left them (`replan_after_cut`, pure), and the driver with the roster carrying a cut and an admission out."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore

from flodl.coordinator.driver import EpochSchedule
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.roster import SurvivingRoster
from flodl.coordinator.survivors import SurviveSettings
from flodl.coordinator.sync_driver import Replan, SyncDriver, replan_after_cut
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.messages import Joined, Message, Regroup, Regrouped, StartEpoch, decode
from flodl.links.transport import Mailbox, inbox
from flodl.metrics.timeline import Timeline


@pytest.mark.parametrize(
    ("position", "first", "planned", "next_to_emit", "expected"),
    [
        # Cut in the middle of the epoch: its rest goes to the members.
        ((2, 3), 0, 2, 2, Replan(rest_of=(2, 3), again=None, fresh=range(3, 3))),
        # ...and an epoch planned ahead of it (lookahead) is planned afresh after the rest.
        ((2, 3), 0, 3, 2, Replan(rest_of=(2, 3), again=None, fresh=range(3, 4))),
        # Cut at the end of the last planned epoch, not emitted yet: its eval and checkpoint parts again.
        ((2, 6), 0, 2, 2, Replan(rest_of=None, again=(2, 6), fresh=range(3, 3))),
        # ...already emitted: nothing to ask again.
        ((2, 6), 0, 2, 3, Replan(rest_of=None, again=None, fresh=range(3, 3))),
        # At the end of an epoch with the next one planned: that one afresh, the finished one's parts again.
        ((2, 6), 0, 3, 2, Replan(rest_of=None, again=(2, 6), fresh=range(3, 4))),
        # Nothing trained yet in this run: the first epoch afresh (a resumed run's too).
        ((-1, 0), 0, 0, 0, Replan(rest_of=None, again=None, fresh=range(0, 1))),
        ((-1, -1), 5, 5, 5, Replan(rest_of=None, again=None, fresh=range(5, 6))),
        # The members agree on the start of an epoch (step 0): planned afresh, the one before asked again.
        ((3, 0), 0, 3, 2, Replan(rest_of=None, again=(2, 6), fresh=range(3, 4))),
    ],
)
def test_the_members_agreed_position_decides_what_is_planned_again(
    position: tuple[int, int], first: int, planned: int, next_to_emit: int, expected: Replan
) -> None:
    end_steps = {2: 6, 3: 6, 0: 6, 5: 6}
    assert replan_after_cut(position, first, planned, next_to_emit, end_steps) == expected


def drain(store: HashStore, rank: int) -> list[Message]:
    """Every message waiting in `rank`'s inbox, in order."""
    return [decode(store.queue_pop(inbox(rank), block=False)) for _ in range(store.queue_len(inbox(rank)))]


class Run:
    """A sync driver of 3 ranks and 2 epochs of 48 picks (4 steps of 4 each), survive's roster around it."""

    def __init__(self) -> None:
        self.store = HashStore()
        outbox = Mailbox(self.store, "coordinator")
        schedule = EpochSchedule(
            epochs=2, world_size=3, total_picks=48, batch_size=4, eval_every=0, has_eval=False
        )
        self.ledger = EpochLedger(epochs=2, world_size=3, batches_per_epoch=12)
        monitor = HeartbeatMonitor(3, timeout_s=10.0, started=0.0)
        settings = SurviveSettings(min_ranks=1, capacity=3)
        self.roster = SurvivingRoster(3, outbox, monitor, self.ledger, Timeline(3), settings)
        self.driver = SyncDriver(schedule, self.ledger, outbox, self.roster, 0, lookahead=0)
        self.stops: list[str] = []
        self.roster.attach(self.driver, self.stop, lambda: "none")

    def stop(self, reason: str) -> int:
        self.stops.append(reason)
        return self.driver.stop()


def test_a_cut_regroups_the_members_and_plans_the_rest_where_they_agreed_it_ended() -> None:
    run = Run()
    run.driver.begin()
    assert [type(m) for r in range(3) for m in drain(run.store, r)] == [StartEpoch] * 3
    run.roster.cut(2, "its process ended")
    assert (run.roster.generation, run.roster.members) == (1, {0, 1})
    for rank in (0, 1):
        assert drain(run.store, rank) == [Regroup(1, [0, 1], [], shares_state=True)]
    run.roster.on_regrouped(Regrouped(0, 1, 1.0, 2.0, position=[0, 2]))
    run.driver.on_regrouped(Regrouped(0, 1, 1.0, 2.0, position=[0, 2]))
    # 3 members x 2 untrained steps x 4 picks, shared by 2 members: 3 steps each, from step 2 on.
    for rank in (0, 1):
        (rest,) = drain(run.store, rank)
        assert isinstance(rest, StartEpoch)
        assert (rest.epoch, rest.generation, rest.first_step, sum(s.size for s in rest.slices)) == (
            0,
            1,
            2,
            12,
        )


def test_a_restarted_rank_is_admitted_in_order_with_the_next_epoch_and_holds_the_model_once_formed() -> None:
    run = Run()
    run.driver.begin()
    run.roster.cut(2, "its process ended")
    run.roster.on_joined(Joined(2, incarnation=1, startup_s=3.0))
    assert run.roster.joiners == {2}
    run.driver.on_epoch_emitted(0)  # the next epoch is planned: the joiner is admitted first
    assert (run.roster.generation, run.roster.members, run.roster.holders) == (2, {0, 1, 2}, {0, 1})
    admission = Regroup(2, [0, 1, 2], [2], shares_state=True, in_order=True)
    for rank in (0, 1, 2):  # the cut rank's inbox was emptied: the admission is its first message
        *_, regroup, plan = drain(run.store, rank)
        assert regroup == admission
        assert isinstance(plan, StartEpoch) and (plan.epoch, plan.generation) == (1, 2)
    run.roster.on_regrouped(Regrouped(2, 2, 1.0, 2.0))
    assert run.roster.holders == {0, 1, 2}
    assert run.stops == []
