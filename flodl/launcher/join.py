"""`flodl-join RUN_DIR`: one more rank for a running fault_tolerance=survive job, in a free seat.

A job whose `launch.max_ranks` is above the ranks it starts with writes a join card in its run dir
(`.launch/join.json`: where its store listens, its resolved config, its names) for as long as it runs. This
command reads it, takes the lowest free seat past the start's (flodl/links/seats.py), and runs a rank there
under a supervisor of its own, which posts the rank's exit to the coordinator the moment it happens (no
heartbeat waited out) and frees the seat. The rank runs and imports as the job's ranks do, from any directory
(the card's working dir and sys.path: a user's project imports as it did under flodl-train). The coordinator
admits the rank at its next round (cadence, async) or epoch (sync) boundary with the members' parameters and
optimizer state. On another host, the run dir must be one both hosts see and the store reachable
(`flodl-coordinator` with MASTER_ADDR, or `--master-addr`), and the user's project where the job has it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import TCPStore

from flodl.config.schema import to_config
from flodl.config.targets import list_target_problems, task_target_problems
from flodl.job import failures
from flodl.job.rank import self_launched_rank
from flodl.launcher.join_card import JoinCard, JoinError, read_card
from flodl.launcher.rank_exit import SupervisedRankFailure
from flodl.launcher.self_launch import keep_on_loopback
from flodl.launcher.supervisor import SupervisedRank, rank_env, supervise
from flodl.links.group import is_loopback
from flodl.links.seats import seat_left, take_seat
from flodl.links.stop import Stopped

# How long a joiner waits for the run's store to answer before it says the run is not running.
_CONNECT_S = 15.0


def join(run_dir: Path, store_addr: str | None = None, local_rank: int | None = None) -> int:
    """Run one rank of the job in `run_dir` in a free seat until it leaves; its exit code (0: it trained to
    the run's end)."""
    card = read_card(run_dir)
    _import_as_the_job(card, run_dir)
    addr = store_addr or card.store_addr
    store = _connect(addr, card.store_port, run_dir)
    taken = take_seat(store, card.world_size, card.capacity)
    if taken is None:
        raise JoinError(
            f"every seat of the job in {run_dir} is taken (launch.max_ranks={card.capacity}; the ranks it "
            "started with keep theirs): try again once a rank left, or start the job with more"
        )
    seat, incarnation = taken
    if is_loopback(addr):
        keep_on_loopback()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env = rank_env(seat, card.world_size, addr, card.store_port, local_rank)
    print(
        f"flodl: rank {seat} joins the run in {run_dir} (its log: {run_dir / f'rank{seat}.log'})",
        file=sys.stderr,
    )
    since = time.time()
    try:
        supervise(
            self_launched_rank,
            (card.config, card.info),
            [SupervisedRank(seat, env, restarts_left=0, incarnation=incarnation)],
            card.start_method,
            store,
            run_dir,
            ended=lambda: False,  # its rank ends well only when the run told it
        )
    except SupervisedRankFailure as err:
        cause = why_left(err, run_dir, card.info["uid"], seat, since)
        print(
            f"flodl: rank {seat} left the run before its end ({cause}); see {run_dir / f'rank{seat}.log'}",
            file=sys.stderr,
        )
        return 1
    except Stopped as stop:
        return stop.exit_code
    finally:
        seat_left(store, seat, incarnation)
    return 0


def why_left(err: SupervisedRankFailure, run_dir: Path, uid: str, seat: int, since: float) -> str:
    """How the joiner's rank ended and, where it recorded why since `since` (a failure it words exits with
    EXIT_WORDED), that cause: `exit code 3: ValueError: ...`. Its records are attempt 0's: flodl's supervisor
    starts a rank as a new incarnation, never a torch restart."""
    ended = err.exits[-1].cause if err.exits else "it ended"
    said = [f for f in failures.recorded(run_dir, uid, 0, seat) if f.time >= since]
    return f"{ended}: {said[0].cause}" if said else ended


def _import_as_the_job(card: JoinCard, run_dir: Path) -> None:
    """Run and import as the job's ranks do, from wherever flodl-join was started: in the job's working dir
    (where it is on this host), with its sys.path ahead of this process's, which the rank inherits. The task's
    parts and the callbacks must import so here: else one line naming the import, before a seat is taken."""
    if Path(card.cwd).is_dir():
        os.chdir(card.cwd)
    sys.path[:] = [*card.sys_path, *(entry for entry in sys.path if entry not in card.sys_path)]
    cfg = to_config(card.config)
    problems = task_target_problems(cfg) + list(list_target_problems("callbacks", cfg.callbacks))
    if problems:
        raise JoinError(f"no rank joins the job in {run_dir} from here: {'; '.join(problems)}")


def _connect(addr: str, port: int, run_dir: Path) -> TCPStore:
    try:
        return TCPStore(addr, port, None, is_master=False, timeout=timedelta(seconds=_CONNECT_S))
    except (RuntimeError, OSError) as err:
        raise JoinError(
            f"the job in {run_dir} does not answer at {addr}:{port} ({type(err).__name__}): it has ended, or "
            "its store is not reachable from here (--master-addr)"
        ) from None


def main(argv: list[str] | None = None) -> None:
    """`flodl-join`."""
    parser = argparse.ArgumentParser(prog="flodl-join", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the running job's run dir (hydra.run.dir)")
    parser.add_argument("--master-addr", help="where the job's store listens, seen from this host")
    parser.add_argument(
        "--local-rank", type=int, help="this host's GPU index for the rank (default: its seat)"
    )
    args = parser.parse_args(argv)
    try:
        sys.exit(join(args.run_dir.absolute(), args.master_addr, args.local_rank))
    except JoinError as err:
        print(f"flodl: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
