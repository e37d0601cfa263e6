"""The per-rank supervisor of fault_tolerance=survive (flodl/launcher/supervisor.py), with real processes and
a real TCPStore: the ranks are forked (from a fork server) and run tests/helpers/supervised.py; a thread of
the test plays the run host's part (cuts, the run's end) and releases the ranks once it has seen what it came
for. Rank 0 is a rank like any other: it may die and be started again."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from flodl.launcher import supervisor
from flodl.launcher.rank_exit import RankExit, SupervisedRankFailure
from flodl.launcher.supervisor import host_ranks, supervise
from flodl.links.group import loopback_store
from flodl.links.membership import ExitReader, cut_key
from flodl.links.stop import Stopped
from tests.helpers.supervised import ENDED, RELEASE, VARIABLES, kill_key, pid_key, rank_main

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(30)]

WORLD = 4
# Ranks are forked from a clean server process, not from this one: a fork of the test process inherits the
# threads of earlier tests (data-plane readers, queue feeders) and a lock one of them may hold (seen in CI: a
# rank that never started). The server imports the ranks' module once, so a rank still starts in milliseconds.
START_METHOD = "forkserver"
multiprocessing.get_context(START_METHOD).set_forkserver_preload(["tests.helpers.supervised"])
POLL_S = 0.05
STORE_TIMEOUT = timedelta(seconds=15)


@pytest.fixture(autouse=True)
def no_rank_left() -> Iterator[None]:
    """A test that failed or timed out inside `supervise` leaves none of its processes behind."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join()


@pytest.fixture
def store() -> TCPStore:
    return loopback_store(0, None, STORE_TIMEOUT)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged() -> Iterator[list[str]]:
    """The warnings of the "flodl" logger, whether or not it propagates (a rank's logging turns it off)."""
    kept = Kept()
    logging.getLogger("flodl").addHandler(kept)
    yield kept.lines
    logging.getLogger("flodl").removeHandler(kept)


def run(
    store: TCPStore,
    tmp_path: Path,
    plan: dict[int, str],
    world: int,
    max_restarts: int,
    spare: bool = False,
) -> list[RankExit]:
    return supervise(
        rank_main,
        (store.port, str(tmp_path), plan),
        host_ranks(world, store.port, max_restarts),
        START_METHOD,
        store,
        tmp_path / "logs",
        lambda: store.check([ENDED]),
        poll_s=POLL_S,
        spare_imports=("tests.helpers.supervised",) if spare else (),
    )


def until(done: Callable[[], bool], what: str, within_s: float = 15) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def starts(tmp_path: Path, rank: int) -> list[dict[str, str]]:
    path = tmp_path / f"rank{rank}.starts"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def in_order(exits: list[RankExit]) -> list[RankExit]:
    return sorted(exits, key=lambda ended: (ended.rank, ended.incarnation))


def pid_of(client: TCPStore, rank: int, start: int) -> int:
    client.wait([pid_key(rank, start)])
    return int(client.get(pid_key(rank, start)))


def gone(pid: int) -> bool:
    """Ended and reaped by its parent: a zombie still counts as there."""
    return not psutil.pid_exists(pid)


def stopped(pid: int) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    return False


def assert_dead(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@contextlib.contextmanager
def conducted(port: int, script: Callable[[TCPStore], None]) -> Iterator[None]:
    """Run `script` on a thread with a store client of its own while the test supervises. The ranks are
    released after it, and the run ended, whether or not it failed; its failure is raised after the block."""
    errors: list[BaseException] = []

    def body() -> None:
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
        try:
            script(client)
        except BaseException as err:
            errors.append(err)
        finally:
            client.set(RELEASE, "1")
            client.set(ENDED, "1")

    thread = threading.Thread(target=body, name="conductor", daemon=True)
    thread.start()
    yield
    thread.join(timeout=15)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_dead_or_cut_rank_alone_is_started_again_and_the_others_train_on(
    max_restarts: int, store: TCPStore, tmp_path: Path, warnings_logged: list[str]
):
    """Rank 0 SIGKILLs itself and rank 2 SIGSTOPs itself (first incarnation only), and the coordinator's
    cut of rank 2 must really end it; with restarts each comes back once (rank 0 like any other), without,
    ranks 1 and 3 finish."""
    restarts = max_restarts > 0

    def script(client: TCPStore) -> None:
        died = pid_of(client, 0, 1)
        until(lambda: gone(died), "rank 0's first incarnation is reaped")
        hung = pid_of(client, 2, 1)
        until(lambda: stopped(hung), "rank 2 has stopped itself")
        client.set(cut_key(2), "0")
        until(lambda: gone(hung), "the cut rank 2 is killed and reaped")
        assert not client.check([cut_key(2)]), "the supervisor acted on the cut but left its key"
        if restarts:
            pid_of(client, 0, 2)
            pid_of(client, 2, 2)
            client.set(cut_key(0), "0")  # incarnation 0 of rank 0 is gone: a stale cut, to be ignored
            until(lambda: not client.check([cut_key(0)]), "the supervisor took the stale cut")

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with conducted(store.port, script):
        exits = run(store, tmp_path, {0: "kill", 2: "hang"}, WORLD, max_restarts)

    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    # The coordinator hears of rank 0's death at once; not of rank 2's, which it cut itself.
    posted = [(e["rank"], e["incarnation"], e["cause"]) for e in ExitReader(store).new()]
    assert posted == [(0, 0, "signal SIGKILL")], posted
    expected = [
        RankExit(0, 0, None, "SIGKILL"),
        RankExit(1, 0, 0, None),
        RankExit(2, 0, None, "SIGKILL", cut=True),
        RankExit(3, 0, 0, None),
    ]
    if restarts:  # the stale cut left rank 0's second incarnation alone: it finished
        expected += [RankExit(0, 1, 0, None), RankExit(2, 1, 0, None)]
    assert in_order(exits) == in_order(expected)
    # Ranks 1 and 3 started once (their pids unchanged), 0 and 2 once per incarnation, each with its env.
    for rank in range(WORLD):
        seen = starts(tmp_path, rank)
        assert len(seen) == (2 if restarts and rank in (0, 2) else 1), seen
        for start in seen:
            assert {v: start[v] for v in VARIABLES} == {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
    then = "starting it again as incarnation 1 (0 restart(s) left)" if restarts else "no restarts left"
    pids = [starts(tmp_path, rank)[0]["pid"] for rank in (0, 2)]
    assert len(warnings_logged) == 2, warnings_logged
    assert warnings_logged[0].startswith(
        f"rank 0 (pid {pids[0]}, incarnation 0) died (signal SIGKILL); {then}"
    )
    assert warnings_logged[1].startswith(
        f"rank 2 (pid {pids[1]}, incarnation 0) was cut by the coordinator (signal SIGKILL); {then}"
    )


def spares() -> list[int]:
    return [child.pid for child in multiprocessing.active_children() if child.name == "flodl-spare"]


def test_a_rank_started_again_is_the_spare_started_before_it_died(store: TCPStore, tmp_path: Path):
    """With a spare, the supervisor keeps one process started ahead while restarts are left; a rank that dies
    is started again as that process (its imports done), with the rank's env, and the next spare starts;
    none outlives the run, and none is kept once no restart is left."""
    seen: dict[str, object] = {}

    def script(client: TCPStore) -> None:
        first = [pid_of(client, rank, 1) for rank in range(2)]
        until(lambda: len(spares()) == 1, "a spare is started beside the ranks")
        (ahead,) = spares()
        assert ahead not in first
        client.set(kill_key(0), "1")
        seen["restarted"], seen["ahead"] = pid_of(client, 0, 2), ahead
        until(lambda: spares() not in ([], [ahead]), "the next spare starts")
        seen["next"] = spares()[0]
        # Rank 0's last restart used, rank 1's left: the spare stays until the run ends.

    with conducted(store.port, script):
        exits = run(store, tmp_path, {0: "kill-when-told"}, 2, max_restarts=1, spare=True)

    assert seen["restarted"] == seen["ahead"]
    assert starts(tmp_path, 0)[1]["RANK"] == "0"
    assert in_order(exits) == [
        RankExit(0, 0, None, "SIGKILL"),
        RankExit(0, 1, 0, None),
        RankExit(1, 0, 0, None),
    ]
    assert spares() == []
    assert_dead([int(seen["next"])])  # type: ignore[call-overload]


def test_once_the_run_ended_no_rank_outlives_it(
    store: TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The run's host says the run ended: the ranks have a while (cut short here) to leave, then SIGTERM, and
    a rank that ignores it SIGKILL."""
    monkeypatch.setattr(supervisor, "_FINISH_S", 0.5)
    monkeypatch.setattr(supervisor, "_TERM_S", 1.0)

    def end_the_run() -> None:  # once every rank is up, without releasing them
        client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=STORE_TIMEOUT)
        for rank in range(3):
            pid_of(client, rank, 1)
        client.set(ENDED, "1")

    ender = threading.Thread(target=end_the_run, daemon=True)
    ender.start()
    began = time.monotonic()
    exits = run(store, tmp_path, {2: "stubborn"}, 3, max_restarts=2)
    ender.join()
    assert time.monotonic() - began < 6
    assert in_order(exits) == [
        RankExit(0, 0, None, "SIGTERM"),
        RankExit(1, 0, None, "SIGTERM"),
        RankExit(2, 0, None, "SIGKILL"),
    ]
    assert_dead([int(store.get(pid_key(rank, 1))) for rank in range(3)])


def test_every_rank_failing_for_good_fails_the_run_and_every_rank_stopping_stops_it(
    store: TCPStore, tmp_path: Path
):
    """No rank left and none to start again: a failure, naming each rank's end; when each stopped on the same
    signal (as a stop posted through the store ends them), the run's stop."""
    failed = r"every rank ended before the run \(rank 0: exit code 1, "
    with pytest.raises(SupervisedRankFailure, match=failed):
        run(store, tmp_path, dict.fromkeys(range(3), "exit:1"), 3, max_restarts=0)
    # A store of its own: a rank follows its plan at its first start only.
    with pytest.raises(Stopped) as stop:
        run(loopback_store(0, None, STORE_TIMEOUT), tmp_path, dict.fromkeys(range(3), "exit:143"), 3, 1)
    assert stop.value.signum == signal.SIGTERM


def supervise_until_stopped(out: str) -> None:
    """The supervisor of the stop test, in a process (group) of its own: it exits as a stopped launcher."""
    os.setpgrp()
    store = loopback_store(0, None, STORE_TIMEOUT)
    try:
        run(store, Path(out), dict.fromkeys(range(3), "record-stop"), 3, max_restarts=1)
    except Stopped as stop:
        os._exit(stop.exit_code)


def test_a_stop_signal_to_the_supervisor_reaches_every_rank_and_stops_it(tmp_path: Path):
    # A fresh interpreter for the supervisor too, for the same reason as START_METHOD.
    child = multiprocessing.get_context("spawn").Process(
        target=supervise_until_stopped, args=(str(tmp_path),)
    )
    child.start()
    try:
        until(lambda: all(starts(tmp_path, rank) for rank in range(3)), "every rank is started and ready", 25)
        os.kill(child.pid, signal.SIGINT)  # to the supervisor alone: the ranks hear it from it
        child.join(timeout=15)
        assert child.exitcode == 130
        assert [(tmp_path / f"rank{rank}.signal").read_text() for rank in range(3)] == ["SIGINT"] * 3
        assert_dead([starts(tmp_path, rank)[0]["pid"] for rank in range(3)])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.join()
