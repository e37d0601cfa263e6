"""fault_tolerance=survive's pieces, each on its own: the heartbeat monitor's forgetting, a membership
change's timing, the averaging group over real gloo (three ranks forked from a fork server), and a rank's wait
for the coordinator's word over a real store inbox."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import HashStore, TCPStore
from torch.nn.parallel import DistributedDataParallel

from flodl.averaging.ddp_hooks import SettledBuckets, settled_gradient_hook
from flodl.averaging.reducer import Reducer
from flodl.coordinator.driver import EpochSchedule
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.roster import Roster
from flodl.coordinator.survivors import MembershipChange
from flodl.coordinator.sync_driver import SyncDriver
from flodl.links.group import loopback_store
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.membership import AveragingGroup, Superseded
from flodl.links.messages import AverageNow, ExtendPartition, FirstStep, Regroup, Shutdown
from flodl.links.transport import InboxReader, Mailbox
from flodl.worker.group import SurvivingGroup
from flodl.worker.sync import steps_trained_of_cut


def test_a_forgotten_rank_is_never_silent_until_watched_again() -> None:
    monitor = HeartbeatMonitor(3, timeout_s=2.0, started=0.0)
    for rank in range(3):
        monitor.heard(rank, 1.0)
    monitor.forget(2)
    monitor.heard(2, 9.0)  # a cut rank's late beat does not bring it back
    assert monitor.silent(10.0) == [0, 1]
    monitor.watch(2, 10.0)
    assert monitor.silent(11.0) == [0, 1]
    assert monitor.silent(12.5) == [0, 1, 2]
    assert monitor.silence_of(2, 12.5) == pytest.approx(2.5)


def test_a_rank_never_heard_from_has_the_start_s_bound_then_the_heartbeat_s() -> None:
    """A rank still building its task when the coordinator starts (started apart, seconds after the others)
    is no silent rank until launch.timeout_s; once heard, the heartbeat timeout holds."""
    monitor = HeartbeatMonitor(3, timeout_s=2.0, started=0.0, startup_s=60.0)
    monitor.heard(0, 1.0)
    assert monitor.silent(10.0) == [0]
    monitor.heard(1, 30.0)
    assert monitor.silent(33.0) == [0, 1]
    assert monitor.silent(61.0) == [0, 1, 2]
    assert HeartbeatMonitor(3, timeout_s=2.0, started=0.0).silent(2.5) == [0, 1, 2]


def test_a_change_is_done_once_every_member_formed_and_a_round_closed() -> None:
    change = MembershipChange("cut", 2, generation=1, members=[0, 1], why="no heartbeat", started=10.0)
    change.on_formed(0, release_ms=3.0, form_ms=20.0)
    assert change.formed_at is None  # rank 1 has not formed the group yet
    change.on_formed(1, release_ms=500.0, form_ms=25.0)
    assert change.formed_at is not None and not change.done
    change.first_round_at = change.formed_at + 0.5
    assert change.done
    event = change.event()
    assert (event["event"], event["rank"], event["release_ms"], event["form_ms"]) == (
        "rank_cut",
        2,
        500.0,
        25.0,
    )
    assert event["first_round_s"] - event["formed_s"] == pytest.approx(0.5)
    assert "cut out (no heartbeat): members [0, 1]" in change.line() and "first good round" in change.line()
    overtaken = MembershipChange("admitted", 2, generation=2, members=[0, 1, 2], why="incarnation 1")
    assert overtaken.event()["formed_s"] is None and "overtaken by the next change" in overtaken.line()
    assert "overtaken by the run's end" in overtaken.line(run_ended=True)


def test_a_change_is_marked_by_the_first_good_round_of_its_group_or_a_later_one() -> None:
    change = MembershipChange("cut", 2, generation=2, members=[0, 1], why="no heartbeat")
    change.on_good_round(1)  # the group before the change
    assert change.first_round_at is None
    change.on_good_round(2)
    first = change.first_round_at
    assert first is not None
    change.on_good_round(3)
    assert change.first_round_at == first
    overtaken = MembershipChange("admitted", 3, generation=3, members=[0, 1, 3], why="incarnation 1")
    overtaken.on_good_round(4)  # its group was replaced before a round closed in it: the next one's counts
    assert overtaken.first_round_at is not None


def test_sync_names_the_newest_group_whose_first_step_went_through() -> None:
    schedule = EpochSchedule(
        epochs=2, world_size=3, total_picks=48, batch_size=4, eval_every=0, has_eval=False
    )
    ledger = EpochLedger(epochs=2, world_size=3, batches_per_epoch=4)
    outbox = Mailbox(HashStore(), "coordinator")
    roster = Roster(3, outbox, HeartbeatMonitor(3, timeout_s=2.0, started=0.0))
    driver = SyncDriver(schedule, ledger, outbox, roster, first_epoch=0)
    assert roster.good_round_generation == -1
    driver.on_message(FirstStep(0, 0))
    assert roster.good_round_generation == 0
    roster.generation += 1  # rank 2 was cut
    driver.on_message(FirstStep(0, 0))  # late: the group the cut ended
    assert roster.good_round_generation == 0
    driver.on_message(FirstStep(0, 1))
    assert roster.good_round_generation == 1


def test_a_cut_segment_counts_what_the_members_trained_of_it() -> None:
    # The members agreed they stand at step 30 of epoch 2; the segment: 20 steps of epoch 2 from step 5.
    assert steps_trained_of_cut((2, 30), 2, 5, 20, 3) == 20  # every step (a member finished it)
    assert steps_trained_of_cut((2, 12), 2, 5, 20, 3) == 7  # up to step 12: more than this rank's 3
    assert steps_trained_of_cut((2, 6), 2, 5, 20, 3) == 3  # this rank is the furthest
    assert steps_trained_of_cut((3, 0), 2, 5, 20, 3) == 20  # a member is in the next epoch already
    assert steps_trained_of_cut((1, 59), 2, 0, 20, 0) == 0  # died in the segment's first step


def test_the_state_shared_on_a_change_is_a_member_s_never_a_joiner_s() -> None:
    assert Regroup(generation=1, members=[0, 1, 2], shares_state=True).sharer == 0
    assert Regroup(generation=3, members=[0, 1, 2], joining=[0], shares_state=True).sharer == 1
    assert Regroup(generation=4, members=[0, 2, 3], joining=[0, 2], shares_state=True).sharer == 3


def _member(rank: int, port: int, results: multiprocessing.Queue) -> None:
    """One rank of the group test (a process of its own: gloo holds the interpreter while it forms)."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    group = AveragingGroup(store, "gloo", rank, torch.device("cpu"), 10.0)
    state = torch.full((5,), float(rank + 1))
    seen = []
    group.form(0, [0, 1, 2])
    seen.append((group.generation, group.index, group.size))
    if rank != 0:  # rank 0 is out: a group of two, in rank order
        group.form(1, [2, 1])
        seen.append((group.generation, group.index, group.size))
    back = Regroup(generation=2, members=[0, 1, 2], joining=[0], shares_state=True)
    group.form(back.generation, back.members)  # rank 0 is back and receives a member's state: rank 1's
    group.broadcast_from([state], member=back.sharer)
    results.put((rank, seen, state.tolist()))


def three_ranks(target: Callable[..., None], port: int, timeout_s: float) -> list[Any]:
    """What each of three processes running `target(rank, port, results)` put in `results` (one item each).
    Forked from a clean server: a fork of this process could inherit a lock an earlier test's thread holds."""
    context = multiprocessing.get_context("forkserver")
    results = context.Queue()
    ranks = [context.Process(target=target, args=(r, port, results)) for r in range(3)]
    for process in ranks:
        process.start()
    try:
        return [results.get(timeout=timeout_s) for _ in ranks]
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


@pytest.mark.multiproc
def test_the_averaging_group_forms_per_generation_and_hands_a_joiner_a_member_s_state() -> None:
    store = loopback_store(0, None, timedelta(seconds=20))
    got = {rank: (seen, state) for rank, seen, state in three_ranks(_member, store.port, timeout_s=60)}
    assert got[0][0] == [(0, 0, 3)]
    assert got[1][0] == [(0, 1, 3), (1, 0, 2)] and got[2][0] == [(0, 2, 3), (1, 1, 2)]
    assert all(state == [2.0] * 5 for _, state in got.values())


def _left_waiting(rank: int, port: int, results: multiprocessing.Queue) -> None:
    """One rank of the cut-collective test: rank 2 forms each three-rank group and then stays out of its
    collectives, alive and holding its sockets open (as a member does whose own part failed on a dead
    peer's socket); ranks 0 and 1 are left waiting on it until the group is cut (`abort`, as a Regroup does
    on arrival). The group's timeout is far beyond the test's: only the cut can free them."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = AveragingGroup(store, "gloo", rank, torch.device("cpu"), 600.0)
    seen: list[str] = []
    held: list[object] = []  # rank 2's groups: dropping one would close its sockets

    def cut_when_told(generation: int) -> None:
        store.wait([f"cut/{generation}"], timedelta(seconds=60))
        group.abort()

    def stuck(generation: int, prepare: Callable[[], object], collective: Callable[[], object]) -> None:
        group.form(generation, [0, 1, 2])
        prepared = prepare()
        if rank == 2:
            held.extend([group.group, prepared])
            store.set(f"cut/{generation}", "1")
            return
        threading.Thread(target=cut_when_told, args=(generation,), daemon=True).start()
        try:
            collective()
        except RuntimeError as err:  # DDP's backward raises the GroupAborted as a RuntimeError naming it
            seen.append(str(err))

    # A local-SGD round (the reducer) and a DDP backward (the settled bucket hook), each cut, then done again
    # by the two that are left.
    reducer = Reducer(gamma=0.0, backend="gloo", settle=group.settle)
    params = torch.full((1000,), float(rank + 1))
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    inputs = torch.full((2, 4), float(rank + 1))
    ddp: list[DistributedDataParallel] = []

    def on_group() -> None:
        reducer.set_group(group.group, "gloo")

    def reduce() -> None:
        reducer.reduce([params], None, None, steps=1 + rank)

    def wrap() -> DistributedDataParallel:  # a collective of every member
        process_group = group.process_group()
        ddp[:] = [DistributedDataParallel(model, process_group=process_group)]
        ddp[0].register_comm_hook(SettledBuckets(process_group, group.settle), settled_gradient_hook)
        return ddp[0]

    def backward() -> None:
        model.zero_grad()
        ddp[0](inputs).sum().backward()

    stuck(0, on_group, reduce)
    stuck(1, wrap, backward)
    if rank == 2:
        store.wait(["done/0", "done/1"], timedelta(seconds=120))
    else:
        group.form(2, [0, 1])
        on_group()
        reduce()
        wrap()
        backward()
        seen.extend([str(params[0].item()), str(model.weight.grad[0, 0].item())])
        store.set(f"done/{rank}", "1")
    results.put((rank, seen))
    results.close()
    results.join_thread()
    os._exit(0)  # a given-up group would block a destructor until its operation's timeout


@pytest.mark.multiproc
def test_a_cut_frees_a_member_waiting_on_a_live_peer_that_left_the_collective() -> None:
    """gloo has no abort: without waiting in slices, ranks 0 and 1 would wait out the group's timeout."""
    store = loopback_store(0, None, timedelta(seconds=60))
    got = dict(three_ranks(_left_waiting, store.port, timeout_s=120))
    assert got[2] == []
    for rank in (0, 1):
        cuts, after = got[rank][:2], got[rank][2:]
        assert len(cuts) == 2
        for generation, cut in enumerate(cuts):
            assert f"averaging group {generation} was cut while rank {rank} waited on a collective" in cut
        # gamma 0: the two ranks weigh the same; the gradient of sum(w.x) is x, averaged over the two.
        assert after == [str((1.0 + 2.0) / 2), str((1.0 + 2.0) / 2 * 2)]


def test_an_aborted_group_is_marked_and_a_rank_forms_only_groups_it_is_in() -> None:
    group = AveragingGroup(loopback_store(0, None, timedelta(seconds=5)), "gloo", 0, torch.device("cpu"), 5.0)
    group.form(0, [0])
    group.abort()  # gloo: nothing pending to free; the generation is untrustworthy until re-formed
    assert group.aborted.is_set()
    group.form(1, [0])
    assert not group.aborted.is_set()
    with pytest.raises(RuntimeError, match="not in the averaging group"):
        group.form(2, [1, 2])


def test_forming_waits_for_every_member_and_gives_way_to_a_newer_group_or_the_end() -> None:
    store = loopback_store(0, None, timedelta(seconds=5))
    group = AveragingGroup(store, "gloo", 0, torch.device("cpu"), 0.3)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] were not ready within 0.3 s"):
        group.form(0, [0, 1])  # rank 1 never comes
    # Patient (a sync admission): past the timeout, until a newer group is announced...
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))

    def announce_past_the_timeout() -> None:
        client.wait(["averaging/1//ready/0"])  # rank 0 started to form group 1 (PrefixStore adds a /)
        time.sleep(3 * 0.3)  # an impatient form would have given up by now
        group.announce(2)

    threading.Thread(target=announce_past_the_timeout, daemon=True).start()
    with pytest.raises(Superseded, match="overtaken by group 2"):
        group.form(1, [0, 1], patient=True)
    # ...or the run ends.
    threading.Timer(0.5, group.abandoned.set).start()
    with pytest.raises(Superseded, match="the run ended"):
        group.form(3, [0, 1], patient=True)
    assert group.generation == -1, "no group was formed"


def _rank_1_waiting() -> tuple[Mailbox, InboxReader, AveragingGroup, SurvivingGroup]:
    """Rank 1 of 2 under survive with its inbox read over a real store: the coordinator's mailbox that sends
    to it, its reader (started), its averaging group and its surviving group."""
    store = loopback_store(0, None, timedelta(seconds=20))
    sender = Mailbox.connect("127.0.0.1", store.port, "ns", "coordinator", 10.0)
    reader = InboxReader(Mailbox.connect("127.0.0.1", store.port, "ns", 1, 10.0))
    group = AveragingGroup(store, "gloo", 1, torch.device("cpu"), 10.0)
    survival = SurvivingGroup(group, reader, 2, incarnation=0, joining=False, wait_s=10.0)
    reader.start()
    return sender, reader, group, survival


def test_a_rank_waiting_for_the_coordinator_keeps_what_else_came_and_ends_with_the_run() -> None:
    sender, reader, group, survival = _rank_1_waiting()
    regroup = Regroup(generation=1, members=[0, 1], cut_round=4)
    for message in (AverageNow(round=4), regroup, ExtendPartition([], 0)):
        sender.send(1, message)
    assert survival.await_regroup("round 4 was cut", None) == regroup
    assert group.aborted.is_set()  # the Regroup freed whatever the loop was blocked in, on arrival
    assert reader.next_message(5.0) == AverageNow(round=4)  # given back, in order, before the queue's
    assert reader.next_message(5.0) == ExtendPartition([], 0)
    # A restart waits for its admission; what was meant for its previous incarnation is dropped.
    joiner = SurvivingGroup(group, reader, 2, incarnation=1, joining=True, wait_s=10.0)
    assert joiner.joining
    admission = Regroup(generation=2, members=[0, 1], joining=[1])
    for message in (AverageNow(round=5), regroup, admission):
        sender.send(1, message)
    assert joiner.await_admission() == admission
    assert reader.next_message(None) is None
    sender.send(1, Shutdown("done"))  # the run ends first: no Regroup, and the loop still sees the end
    assert survival.await_regroup("round 6 was cut", None) is None
    assert group.abandoned.is_set()  # a group still forming stops waiting for its members
    assert reader.next_message(5.0) == Shutdown("done")


def test_a_failure_no_change_follows_is_raised_as_what_it_was() -> None:
    """A step that failed for its own reasons (the task's loss raised) waits for a Regroup that never comes,
    then fails naming the cause."""
    store = loopback_store(0, None, timedelta(seconds=20))
    reader = InboxReader(Mailbox.connect("127.0.0.1", store.port, "ns", 1, 10.0))
    group = AveragingGroup(store, "gloo", 1, torch.device("cpu"), 10.0)
    survival = SurvivingGroup(group, reader, 2, incarnation=0, joining=False, wait_s=0.5)
    reader.start()
    cause = ValueError("the loss of batch 7 is a string")
    with pytest.raises(RuntimeError, match="no member's death: ValueError: the loss of batch 7") as raised:
        survival.await_regroup("epoch 2 was cut", cause)
    assert raised.value.__cause__ is cause


def test_a_cut_round_s_cause_is_logged_on_one_line_cut_at_a_word(caplog: pytest.LogCaptureFixture) -> None:
    """gloo's errors run long: the warning keeps whole words, and says it shortened the cause."""
    sender, _, _, survival = _rank_1_waiting()
    text = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40915"
    cause = RuntimeError(text + " while the all-reduce of bucket 3 waited" * 6 + "\nException raised from")
    regroup = Regroup(generation=1, members=[0, 2], cut_round=4)
    sender.send(1, regroup)
    with caplog.at_level(logging.WARNING, logger="flodl"):
        assert survival.await_regroup("the round's collective failed", cause) == regroup
    (line,) = [r.getMessage() for r in caplog.records if "waiting for the new group" in r.getMessage()]
    why = line.split(" (RuntimeError: ", 1)[1].removesuffix("); waiting for the new group")
    assert why.startswith(text) and why.endswith(" …") and len(why) <= 200, why
    assert set(why.removesuffix(" …").split()) <= set(str(cause).split()), why  # whole words only


class _EndsAfterTheSlice:
    """A collective that ends in the moment between a slice's timeout and the waiter's next look (seen on one
    H200: gloo on CUDA tensors, a joiner's first round): its slice raises "Operation timed out!", then it is
    complete, with `error` (None: it succeeded)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.sliced = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self.sliced:
            self.sliced = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.sliced


def test_a_collective_that_ends_as_its_wait_slice_times_out_settles_with_its_own_outcome() -> None:
    group = AveragingGroup(loopback_store(0, None, timedelta(seconds=5)), "gloo", 0, torch.device("cpu"), 5.0)
    group.form(0, [0])
    group.settle(_EndsAfterTheSlice(None))  # type: ignore[arg-type]  # succeeded: no error, no cut
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        group.settle(_EndsAfterTheSlice(RuntimeError("Connection closed by peer")))  # type: ignore[arg-type]
