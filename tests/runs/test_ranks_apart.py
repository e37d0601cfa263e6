"""Ranks started apart beside flodl-coordinator with launch.max_restarts > 0: each `flodl-train` supervises
its rank (flodl/launcher/apart.py). A fault on one rank, SIGKILL or a SIGSTOP past the heartbeat timeout, at a
moment drawn from a seed, is its supervisor's to mend: the rank is cut, started again as incarnation 1 and
admitted back, while every command the user started runs on to the run's end; every epoch once, one final
state. Without restarts a rank runs in the command's own process (tests/runs/test_survive.py starts ranks
one by one so, their restart loop the test's)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.procs import (
    PYTHON,
    TRAIN,
    child_env,
    finish,
    free_port,
    kill_left,
    start,
    wait_for,
)
from tests.helpers.stops import check_stop_kept_every_step, stopped_by_sigterm
from tests.helpers.survive_runs import (
    EPOCHS_AT_MOST,
    STOP_ONCE_ADMITTED,
    check_every_epoch_once,
    digests,
    membership,
)

pytestmark = pytest.mark.multiproc

COORDINATOR = str(Path(PYTHON).parent / "flodl-coordinator")
RANKS = 3
# How the coordinator words a cut for each fault: the process's end (the supervisor's post, or its
# connection to the run's host closing, whichever it reads first), or the silence of a frozen rank.
CUT_FOR = {
    "kill": r"its process ended: (signal SIGKILL|its connection to the run's host closed)",
    "freeze": "no heartbeat",
}


def fault_of(seed: int) -> tuple[str, int, int]:
    """The fault a seed draws: its kind, its rank, and the epochs recorded before it."""
    draw = random.Random(seed)
    return draw.choice(["kill", "freeze"]), draw.randrange(RANKS), draw.randrange(1, 5)


def recorded_epochs(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def start_job(tmp_path: Path, overrides: list[str], **coordinator_io: int) -> list[subprocess.Popen]:
    """flodl-coordinator, then each rank's command apart: [coordinator, rank 0, rank 1, ...]."""
    job = {"WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [start([COORDINATOR, *overrides], tmp_path, child_env(**job), **coordinator_io)]
    for r in range(RANKS):
        procs.append(start([PYTHON, TRAIN, *overrides], tmp_path, child_env(RANK=str(r), **job)))
    return procs


def rank_pid(run: Path, rank: int) -> int:
    """The pid of the last process that started as `rank` (each start names it in the rank's log)."""
    return int(re.findall(rf"rank {rank}/\d+ \(pid (\d+)\)", (run / f"rank{rank}.log").read_text())[-1])


@pytest.mark.parametrize("seed", [2, 17])
def test_a_rank_apart_is_started_again_by_its_own_command(tmp_path: Path, seed: int) -> None:
    kind, victim, after = fault_of(seed)
    overrides = [
        "fault_tolerance=survive",
        "hydra.run.dir=run",
        "heartbeat_timeout_s=2",
        "launch.max_restarts=2",
        "policy=cadence",
        f"epochs={EPOCHS_AT_MOST}",
        "batch_size=8",
        "eval_every=0",
        "checkpoint_every=null",
        STOP_ONCE_ADMITTED,
    ]
    coordinator, *ranks = start_job(tmp_path, overrides)
    run = tmp_path / "run"
    try:
        wait_for(lambda: recorded_epochs(run) >= after, coordinator, what=f"{after} epochs recorded")
        pid = rank_pid(run, victim)
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        hosted = finish(coordinator, 180)
        ended = [finish(r, 60) for r in ranks]
    finally:
        kill_left([coordinator, *ranks])
    codes = [r.code for r in ended]
    assert hosted.code == 0 and codes == [0] * RANKS, (kind, victim, codes, [r.out[-2000:] for r in ended])
    check_every_epoch_once(run)
    events = membership(run)
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", victim), ("rank_admitted", victim)]
    assert re.match(CUT_FOR[kind], events[0]["why"]), events[0]
    log = (run / f"rank{victim}.log").read_text()
    # Its own command started it again: the store's count of its starts says 1.
    assert re.search(rf"rank {victim} \(pid {pid}, incarnation 0\) .*starting it again as incarnation 1", log)
    if kind == "freeze":  # ended once its cut was read, not left frozen
        assert "was cut by the coordinator (signal SIGKILL)" in log, log[-2000:]
    final = digests("".join((run / f"rank{r}.log").read_text() for r in range(RANKS)), "final round")
    assert set(final) == set(range(RANKS)) and len(set(final.values())) == 1, final


@pytest.mark.parametrize(("signalled", "seed"), [("host", 5), ("every process", 8)])
def test_a_stop_signal_to_the_run_s_host_saves_every_step_then_stops(
    tmp_path: Path, signalled: str, seed: int
) -> None:
    """SIGTERM to flodl-coordinator alone (a scheduler that signals the job's first process), or to every
    process of the job, at a moment drawn from a seed: the run stops as on a member's signal, the ranks saving
    a checkpoint at the next boundary, which holds every step each rank trained, and every command exits 143.
    The host's own signal once ended the run where it was: no checkpoint since the last periodic one."""
    after = random.Random(seed).randrange(1, 6)
    overrides = [
        "fault_tolerance=survive",
        "hydra.run.dir=run",
        "policy=async",
        f"epochs={EPOCHS_AT_MOST}",
        "batch_size=8",
        "eval_every=0",
        "checkpoint_every=null",
        "checkpoint_every_s=3600",  # none due: only the stop's
    ]
    coordinator, *ranks = start_job(tmp_path, overrides, errors=subprocess.PIPE)
    run = tmp_path / "run"
    try:
        wait_for(lambda: recorded_epochs(run) >= after, coordinator, what=f"{after} epochs recorded")
        for proc in [coordinator] if signalled == "host" else [coordinator, *ranks]:
            proc.send_signal(signal.SIGTERM)
        hosted = finish(coordinator, 120)
        codes = [finish(r, 60).code for r in ranks]
    finally:
        kill_left([coordinator, *ranks])
    stopped_at, _ = stopped_by_sigterm(hosted)
    assert codes == [143] * RANKS, codes
    check_stop_kept_every_step(run, stopped_at, stops=1)
    assert sorted(stopped_at.part_ranks) == list(range(RANKS))
