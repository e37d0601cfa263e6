"""fault_tolerance=survive: the self-launched ranks as processes of their own, each death its own event.

torch's elastic agent ends every rank when one fails (and restarts them all). Here each rank is watched
alone: a rank that dies, or that the coordinator cuts, is started again while it has restarts left, else the
others train on without it; rank 0 is a rank like any other. The supervisor's process hosts the ranks'
store (they join it as clients) and the run itself (flodl/job/host.py: the coordinator, on a thread): the
supervisor posts each death there for the coordinator, the coordinator its cuts for the supervisor, and the
supervisor runs until the run's host says the run ended.

A stop (SIGINT / SIGTERM) is no death: one sent to the supervisor is forwarded to every rank, and a rank
that stopped on one (exit code 130 / 143) is not started again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import Any

from torch.distributed import TCPStore

from flodl.config.host import INCARNATION_ENV
from flodl.launcher.rank_exit import RankExit, SupervisedRankFailure, signal_name
from flodl.launcher.spare import Spare
from flodl.links.membership import cut_key, post_exit
from flodl.links.stop import STOP_SIGNALS, Stopped
from flodl.metrics.run_clock import RANK_STARTED_AT_ENV

log = logging.getLogger("flodl")

# Once the run ended, how long the ranks may take to leave on their own.
_FINISH_S = 30.0
# How long a rank may take to exit on SIGTERM before it is killed.
_TERM_S = 5.0
# How long the ranks may take to stop on a forwarded stop signal before they are killed (beyond the time a
# stop's checkpoint may take).
_STOP_S = 10.0


def supervise(
    entry: Callable[..., None],
    args: tuple[Any, ...],
    ranks: list[SupervisedRank],
    start_method: str,
    store: TCPStore,
    log_dir: Path,
    ended: Callable[[], bool],
    poll_s: float = 0.1,
    saving_s: float = 0.0,
    spare_imports: tuple[str, ...] = (),
) -> list[RankExit]:
    """Run `entry(*args)` as each of `ranks` (`host_ranks`: a one-host job's; flodl-join: one rank in a
    seat of a running job) until `ended()` says the run did (its host told the ranks); every exit seen.

    A rank that dies or is cut, rank 0 included, is started again while it has restarts left (counted per
    rank). Raises Stopped when the supervisor is stopped by SIGINT / SIGTERM, or every rank stopped on one,
    and SupervisedRankFailure when every rank ended before the run and none has restarts left; no rank
    outlives the call. Call it from the main thread: it handles those signals. `store`: the run's, where
    exits are posted and cuts read. `saving_s`: how long a stop's checkpoint may take (stop_grace_s), the
    ranks are waited for that much longer on a stop. `spare_imports`: keep a spawned rank's process that
    imported these ready for the next restart while restarts are left (flodl/launcher/spare.py; none: no
    spare).
    """
    context = multiprocessing.get_context(start_method)
    assert isinstance(context, (ForkContext, SpawnContext, ForkServerContext)), (
        start_method
    )  # named, not default
    with StopSignals() as stop:
        spare_of = spare_imports if spare_imports and not isinstance(context, ForkContext) else None
        watch = _Supervisor(
            context, entry, args, ranks, store, log_dir, poll_s, stop, ended, saving_s, spare_of
        )
        try:
            return watch.run()
        finally:
            watch.kill_left()  # an unexpected error here must not leave ranks behind


def host_ranks(world_size: int, store_port: int, max_restarts: int) -> list[SupervisedRank]:
    """Ranks 0..world_size-1 of a one-host job whose store this process hosts on loopback."""
    return [
        SupervisedRank(rank, rank_env(rank, world_size, "127.0.0.1", store_port), max_restarts)
        for rank in range(world_size)
    ]


def rank_env(
    rank: int, world_size: int, store_addr: str, store_port: int, local_rank: int | None = None
) -> dict[str, str]:
    """What torchrun would set for a rank of a job whose store a launcher hosts (`world_size`: the ranks it
    starts with; a rank that joins later sits past them)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": store_addr,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _rank_main(entry: Callable[..., None], args: tuple[Any, ...], env: dict[str, str]) -> None:
    # A forked rank starts with the supervisor's stop handlers, which only take note: give it a fresh
    # interpreter's, so that a signal the supervisor forwards or a SIGTERM it sends takes effect.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    os.environ.update(env)
    entry(*args)


@dataclass
class SupervisedRank:
    rank: int
    env: dict[str, str]
    restarts_left: int
    # Its seat's incarnation (0: the first process in it; a seat taken again by flodl-join: more).
    incarnation: int = 0
    process: BaseProcess | None = None
    # The live incarnation was killed on the coordinator's word; its exit is still to be reaped.
    cut: bool = False
    # Numbers its next start (a rank apart: in the run's store, flodl/launcher/apart.py); None: one more.
    numbered: Callable[[], int] | None = None

    def restarted(self) -> None:
        self.restarts_left -= 1
        self.incarnation = self.numbered() if self.numbered is not None else self.incarnation + 1

    @property
    def live_process(self) -> BaseProcess:
        """The process of a rank `_Supervisor._live` listed."""
        assert self.process is not None, f"rank {self.rank} has no process"
        return self.process


class StopSignals:
    """While supervising, the first SIGINT / SIGTERM is noted for the loop to act on (a handler that raises
    could leave a rank started and not yet recorded); the previous handlers come back afterwards."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            # None: a handler not installed from Python; the default is the closest to it.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum


@dataclass
class _Supervisor:
    context: ForkContext | SpawnContext | ForkServerContext
    entry: Callable[..., None]
    args: tuple[Any, ...]
    ranks: list[SupervisedRank]
    store: TCPStore
    log_dir: Path
    poll_s: float
    stop: StopSignals
    run_ended: Callable[[], bool]
    saving_s: float
    # What a spare imports, or None: no spare.
    spare_of: tuple[str, ...] | None

    def __post_init__(self) -> None:
        self.exits: list[RankExit] = []
        self.spare: Spare | None = None
        self.host_gone = False

    def run(self) -> list[RankExit]:
        for rank in self.ranks:
            self._start(rank)
        self._keep_spare()
        while True:
            ended = self._ended(self.poll_s)
            if self.stop.signum is not None:
                self._stop_all(self.stop.signum)
            if self.run_ended():
                self._finish()
                return self.exits
            for rank in ended:
                self._on_exit(rank)
            self._take_cuts()
            if not self._live() and self._none_left():
                return self.exits

    def _start(self, rank: SupervisedRank) -> None:
        # The supervisor counts the rank's starts: a process killed before it could count its own in the store
        # would have its restart take itself for the first.
        env = {**rank.env, INCARNATION_ENV: str(rank.incarnation), RANK_STARTED_AT_ENV: repr(time.time())}
        args = (self.entry, self.args, env)
        name = f"flodl-rank{rank.rank}"
        spare, self.spare = self.spare, None
        if spare is not None and spare.alive:
            try:
                rank.process = spare.become(_rank_main, args, name)
                return
            except OSError:  # it died just now (its pipe is closed): start one as if there were none
                spare.discard()
        rank.process = self.context.Process(target=_rank_main, args=args, name=name)
        rank.process.start()

    def _keep_spare(self) -> None:
        """A spare ready while a rank may still be started again."""
        if self.spare is not None and not self.spare.alive:
            self.spare.discard()
            self.spare = None
        if self.spare_of is not None and self.spare is None and any(r.restarts_left > 0 for r in self.ranks):
            self.spare = Spare(self.context, self.spare_of)

    def _live(self) -> list[SupervisedRank]:
        return [rank for rank in self.ranks if rank.process is not None]

    def _ended(self, timeout: float) -> list[SupervisedRank]:
        """The live ranks whose process ended, after waiting up to `timeout` for one to end. The exit status
        says so, not the sentinel: a process closes its end before it can be reaped, and a child of a rank
        (a DataLoader worker) may hold it open after the rank died."""
        live = self._live()
        ready = wait([rank.live_process.sentinel for rank in live], timeout=timeout)
        if any(rank.live_process.sentinel in ready and rank.live_process.exitcode is None for rank in live):
            time.sleep(timeout)  # about to be reapable (or it closed its sentinel): look again, no spinning
        return [rank for rank in live if rank.live_process.exitcode is not None]

    def _reap(self, rank: SupervisedRank) -> RankExit:
        """Record the ended process of `rank`."""
        process = rank.process
        assert process is not None and process.exitcode is not None
        code = process.exitcode
        ended = RankExit(
            rank.rank,
            rank.incarnation,
            code if code >= 0 else None,
            signal_name(-code) if code < 0 else None,
            rank.cut,
        )
        process.close()
        rank.process, rank.cut = None, False
        self.exits.append(ended)
        return ended

    def _on_exit(self, rank: SupervisedRank) -> None:
        """Act on the exit of `rank`: a death is posted for the coordinator and restarted if it may be."""
        assert rank.process is not None
        pid = rank.process.pid
        ended = self._reap(rank)
        stop = ended.stop_signal
        if ended.exitcode == 0:
            return
        who = f"rank {rank.rank} (pid {pid}, incarnation {rank.incarnation})"
        how = f"was cut by the coordinator ({ended.cause})" if ended.cut else f"died ({ended.cause})"
        if not ended.cut and stop is None:  # the coordinator cuts it now, not after a heartbeat timeout
            self._at_host(lambda: post_exit(self.store, rank.rank, ended.incarnation, ended.cause))
        if stop is not None and not ended.cut:
            log.warning("%s stopped on %s; it is not started again", who, signal_name(stop))
        elif rank.restarts_left > 0 and self._at_host(rank.restarted):
            log.warning(
                "%s %s; starting it again as incarnation %d (%d restart(s) left)",
                who,
                how,
                rank.incarnation,
                rank.restarts_left,
            )
            self._start(rank)
            self._keep_spare()
        elif self.host_gone:
            log.warning("%s %s; the run's host no longer answers: it is not started again", who, how)
        else:
            log.warning(
                "%s %s; no restarts left (launch.max_restarts): the others go on without it; see %s",
                who,
                how,
                self.log_dir / f"rank{rank.rank}.log",
            )

    def _none_left(self) -> bool:
        """No rank is left and none was started again: True when one finished (a rank ends well only when the
        run told it, just before its host says the run ended); a stop each of them got is the run's stop;
        anything else, a failure."""
        last = {exit.rank: exit for exit in self.exits}
        if any(exit.exitcode == 0 for exit in last.values()):
            return True
        stops = {exit.stop_signal for exit in last.values()}
        signum = stops.pop() if len(stops) == 1 else None
        if signum is not None:
            raise Stopped(signum)
        causes = ", ".join(f"rank {r}: {e.cause}" for r, e in sorted(last.items()))
        raise SupervisedRankFailure(
            f"every rank ended before the run ({causes}) and none has restarts left (launch.max_restarts); "
            f"see {self.log_dir}/rank*.log",
            self.exits,
        )

    def _at_host(self, action: Callable[[], object]) -> bool:
        """`action` on the run's store; False, and no store action from then on, once it does not answer: a
        host apart (flodl-coordinator) that ended or cannot be reached. Its ranks learn the run's fate
        themselves."""
        if self.host_gone:
            return False
        try:
            action()
        except (RuntimeError, OSError):  # torch's DistNetworkError is a RuntimeError
            self.host_gone = True
        return not self.host_gone

    def _take_cuts(self) -> None:
        self._at_host(self._kill_cut)

    def _kill_cut(self) -> None:
        """Kill each rank the coordinator cut: a hung rank (SIGSTOPped, stuck) must really end, so that its
        peers' collectives with it fail and they go on. A cut of an earlier incarnation is stale."""
        for rank in self._live():
            key = cut_key(rank.rank)
            if rank.cut or not self.store.check([key]):
                continue
            incarnation = self.store.get(key).decode()
            self.store.delete_key(key)
            if incarnation == str(rank.incarnation):
                rank.cut = True
                rank.live_process.kill()  # its exit is reaped by the loop, as any other

    def _finish(self) -> None:
        """The run ended: give the ranks `_FINISH_S` to leave, then end them."""
        deadline = time.monotonic() + _FINISH_S
        while self._live() and time.monotonic() < deadline:
            self._await_exits(deadline)
            if self.stop.signum is not None:
                self._stop_all(self.stop.signum)
        for rank in self._live():
            log.warning("rank %d still runs %.0f s after the run ended: ending it", rank.rank, _FINISH_S)
        self._wind_down(signal.SIGTERM, _TERM_S)

    def _stop_all(self, signum: int) -> None:
        """Forward the stop to every live rank and wait for them (they may save a checkpoint first), then
        raise it."""
        self._wind_down(signum, self.saving_s + _STOP_S)
        raise Stopped(signum)

    def _wind_down(self, signum: int, grace_s: float) -> None:
        """Send `signum` to every live rank, wait up to `grace_s` for them, kill what is left."""
        for rank in self._live():
            # Starting a process reaps its ended siblings: a reaped pid may be another process's now.
            process = rank.live_process
            if process.exitcode is None and process.pid is not None:  # a started process has a pid
                os.kill(process.pid, signum)
        deadline = time.monotonic() + grace_s
        while self._live() and time.monotonic() < deadline:
            self._await_exits(deadline)
        self.kill_left()

    def _await_exits(self, deadline: float) -> None:
        """Record the exits that come within one poll (or until `deadline`); nobody is started again now."""
        for rank in self._ended(max(0.0, min(self.poll_s, deadline - time.monotonic()))):
            self._reap(rank)

    def kill_left(self) -> None:
        """SIGKILL every rank still alive and record its end; the spare goes too."""
        if self.spare is not None:
            self.spare.discard()
            self.spare = None
        for rank in self._live():
            rank.live_process.kill()
            rank.live_process.join()
            self._reap(rank)
