"""The per-rank supervisor of fault_tolerance=survive (flodl/supervisor.py), with real processes and a real
TCPStore: the ranks are forked (from a fork server) and run tests/helpers/supervised.py; a thread of the test
plays the coordinator's part (cuts) and releases the ranks once it has seen what it came for."""

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

from flodl import supervisor
from flodl.supervisor import RankExit, SupervisedRankFailure, supervise
from flodl.wire.group import loopback_store
from flodl.wire.membership import ExitReader, cut_key
from flodl.wire.stop import Stopped
from tests.helpers.supervised import RELEASE, VARIABLES, pid_key, rank_main

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
    store: TCPStore, tmp_path: Path, plan: dict[int, str], world: int, max_restarts: int
) -> list[RankExit]:
    return supervise(
        rank_main, (store.port, str(tmp_path), plan), world, max_restarts, START_METHOD, store, store.port,
        tmp_path / "logs", poll_s=POLL_S,
    )  # fmt: skip


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
    released after it, whether or not it failed; its failure is raised after the block."""
    errors: list[BaseException] = []

    def body() -> None:
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
        try:
            script(client)
        except BaseException as err:
            errors.append(err)
        finally:
            client.set(RELEASE, "1")

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
    """Rank 1 SIGKILLs itself and rank 2 SIGSTOPs itself (first incarnation only), and the coordinator's
    cut of rank 2 must really end it; with restarts each comes back once, without, ranks 0 and 3 finish."""
    restarts = max_restarts > 0

    def script(client: TCPStore) -> None:
        died = pid_of(client, 1, 1)
        until(lambda: gone(died), "rank 1's first incarnation is reaped")
        hung = pid_of(client, 2, 1)
        until(lambda: stopped(hung), "rank 2 has stopped itself")
        client.set(cut_key(2), "0")
        until(lambda: gone(hung), "the cut rank 2 is killed and reaped")
        assert not client.check([cut_key(2)]), "the supervisor acted on the cut but left its key"
        if restarts:
            pid_of(client, 1, 2)
            pid_of(client, 2, 2)
            client.set(cut_key(1), "0")  # incarnation 0 of rank 1 is gone: a stale cut, to be ignored
            until(lambda: not client.check([cut_key(1)]), "the supervisor took the stale cut")

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with conducted(store.port, script):
        exits = run(store, tmp_path, {1: "kill", 2: "hang"}, WORLD, max_restarts)

    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    # The coordinator hears of rank 1's death at once; not of rank 2's, which it cut itself.
    posted = [(e["rank"], e["incarnation"], e["cause"]) for e in ExitReader(store).new()]
    assert posted == [(1, 0, "signal SIGKILL")], posted
    expected = [
        RankExit(0, 0, 0, None),
        RankExit(1, 0, None, "SIGKILL"),
        RankExit(2, 0, None, "SIGKILL", cut=True),
        RankExit(3, 0, 0, None),
    ]
    if restarts:  # the stale cut left rank 1's second incarnation alone: it finished
        expected += [RankExit(1, 1, 0, None), RankExit(2, 1, 0, None)]
    assert in_order(exits) == in_order(expected)
    # Ranks 0 and 3 started once (their pids unchanged), 1 and 2 once per incarnation, each with its env.
    for rank in range(WORLD):
        seen = starts(tmp_path, rank)
        assert len(seen) == (2 if restarts and rank in (1, 2) else 1), seen
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
    pids = [starts(tmp_path, rank)[0]["pid"] for rank in (1, 2)]
    assert len(warnings_logged) == 2, warnings_logged
    assert warnings_logged[0].startswith(
        f"rank 1 (pid {pids[0]}, incarnation 0) died (signal SIGKILL); {then}"
    )
    assert warnings_logged[1].startswith(
        f"rank 2 (pid {pids[1]}, incarnation 0) was cut by the coordinator (signal SIGKILL); {then}"
    )


@pytest.mark.parametrize("code", [1, 0])
def test_once_rank_0_ended_no_rank_outlives_it(
    code: int, store: TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Rank 0 failing ends the job at once, naming rank 0; rank 0 finishing leaves the others a while (cut
    short here) to leave. Either way the rest get SIGTERM, and a rank that ignores it SIGKILL."""
    monkeypatch.setattr(supervisor, "_FINISH_S", 0.5)
    monkeypatch.setattr(supervisor, "_TERM_S", 1.0)
    plan = {0: f"exit:{code}", 2: "stubborn"}
    began = time.monotonic()
    if code:
        with pytest.raises(SupervisedRankFailure) as failure:
            run(store, tmp_path, plan, 3, max_restarts=2)
        assert str(failure.value) == (
            "rank 0 (the coordinator) failed (exit code 1); fault_tolerance=survive cannot survive rank 0; "
            f"see {tmp_path / 'logs' / 'rank0.log'}"
        )
        exits = failure.value.exits
    else:
        exits = run(store, tmp_path, plan, 3, max_restarts=2)
    assert time.monotonic() - began < 6
    assert in_order(exits) == [
        RankExit(0, 0, code, None),
        RankExit(1, 0, None, "SIGTERM"),
        RankExit(2, 0, None, "SIGKILL"),
    ]
    assert_dead([int(store.get(pid_key(rank, 1))) for rank in (1, 2)])


def test_rank_0_stopping_is_a_stop_and_stops_the_others(
    store: TCPStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Rank 0 exits 143: it stopped on SIGTERM (its own, or a peer's through the store), which is no failure.
    The others get the same signal, and a rank that ignores it SIGKILL."""
    monkeypatch.setattr(supervisor, "_STOP_S", 1.0)
    with pytest.raises(Stopped) as stop:
        run(store, tmp_path, {0: "exit:143", 2: "stubborn"}, 3, max_restarts=1)
    assert stop.value.signum == signal.SIGTERM
    assert_dead([int(store.get(pid_key(rank, 1))) for rank in (1, 2)])


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
