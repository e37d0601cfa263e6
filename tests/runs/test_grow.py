"""A running fault_tolerance=survive job grows past its start size: 2 self-launched gloo ranks with
launch.max_ranks=4, two more started later with `flodl-join RUN_DIR` (each takes a free seat). Each joiner is
admitted with the members' parameters and optimizer state (bit for bit), every rank's learning rate is the
same after each admission, every epoch is trained and reported once, and the run ends with one state on all
four. A joiner that dies frees its seat at once (its supervisor posts the exit), and the next takes it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from flodl.launcher.join_card import CARD
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TRAIN,
    Child,
    child_env,
    finish,
    free_port,
    kill_group,
    kill_left,
    start,
    wait_for,
)
from tests.helpers.survive_runs import (
    EPOCHS_AT_MOST,
    JOIN,
    check_every_epoch_once,
    check_sync_epochs,
    digests,
    finish_with_joiners,
    membership,
)
from tests.helpers.user_project import write_project

pytestmark = pytest.mark.multiproc

RUN = "hydra.run.dir=run"
GROWN = "callbacks=[{_target_:tests.helpers.callback_log.StopOnceGrown,world:4}]"


def grow_job(tmp_path: Path, policy: str, *overrides: str) -> Child:
    return start(
        [
            PYTHON,
            TRAIN,
            "launch.nproc_per_node=2",
            "launch.max_ranks=4",
            FAST_START,
            "fault_tolerance=survive",
            RUN,
            f"policy={policy}",
            f"epochs={EPOCHS_AT_MOST}",
            "batch_size=8",
            "eval_every=0",
            *overrides,
        ],
        tmp_path,
    )


def joiner(tmp_path: Path, cwd: Path | None = None) -> Child:
    """`flodl-join` for the job in `tmp_path/run`, started in `cwd` (default: where the job was)."""
    return start([JOIN, str(tmp_path / "run")], cwd or tmp_path, child_env())


def admitting(joined: int) -> str:
    """The admission that took `joined` in (alone, or with the other: they may come at one boundary)."""
    return rf"admitting \[(?:\d+, )*{joined}(?:, \d+)*\]"


def admitted_in(logs: str, joined: int) -> dict[int, tuple[str, str]]:
    """Each rank's optimizer fingerprint and learning rate as it logged them after admitting `joined`."""
    found = re.findall(
        rf"rank (\d+): state after {admitting(joined)}[^\n]*, optimizer ([0-9a-f]+), lr (\S+)", logs
    )
    return {int(rank): (digest, lr) for rank, digest, lr in found}


def rank_logs(run: Path) -> str:
    return "".join(path.read_text() for path in sorted(run.glob("rank*.log")))


@pytest.mark.parametrize("policy", ["cadence", "async", "sync"])
def test_a_running_job_grows_past_its_start_and_joiners_take_the_members_state(
    tmp_path: Path, policy: str
) -> None:
    job = grow_job(tmp_path, policy, GROWN)
    run = tmp_path / "run"
    result, codes = finish_with_joiners(job, run, tmp_path, 2)
    result.check()
    assert codes == [0, 0], codes
    assert not (run / CARD).exists(), "the card goes with the run"
    events = membership(run)
    assert sorted((e["event"], e["rank"]) for e in events) == [("rank_admitted", 2), ("rank_admitted", 3)], (
        events
    )
    logs = rank_logs(run)
    for joined in (2, 3):
        # Admitted, every member held the joiner's parameters and global steps, and the joiner the sharer's
        # (rank 0, the first member) optimizer state: its moments, not a fresh Adam's; every rank the same lr.
        admitted = digests(logs, admitting(joined))
        assert set(admitted) >= {0, 1, joined} and len(set(admitted.values())) == 1, admitted
        optimizers = admitted_in(logs, joined)
        assert optimizers[joined][0] == optimizers[0][0], optimizers
        assert len({lr for _, lr in optimizers.values()}) == 1, optimizers
        if policy == "sync":  # DDP steps one optimizer state on every member
            assert len(set(optimizers.values())) == 1, optimizers
    if policy == "sync":  # each epoch planned for its world: every pick but less than one global step
        records, whole = check_sync_epochs(run)
        assert all(whole - r["samples"] < r["world"] * 8 for r in records), [r["samples"] for r in records]
    else:
        records = check_every_epoch_once(run)
    worlds = [r["world"] for r in records]
    assert worlds[0] == 2 and worlds[-1] == 4, worlds
    final = digests(logs, "the last epoch" if policy == "sync" else "final round")
    assert set(final) == {0, 1, 2, 3} and len(set(final.values())) == 1, final
    if policy == "sync":  # the learning rate follows the world (lr_scale_ratio=1: x world)
        assert records[-1]["lr"] == pytest.approx(records[0]["lr"] * 2)


def test_a_joiner_that_dies_frees_its_seat_and_the_next_takes_it(tmp_path: Path) -> None:
    again = GROWN.replace("world:4", "world:3,admissions:2")
    job = grow_job(tmp_path, "cadence", again, "launch.max_ranks=3")
    run = tmp_path / "run"
    joiners: list[Child] = []
    try:
        wait_for((run / CARD).is_file, job, what="the job wrote its join card")
        joiners.append(joiner(tmp_path))
        admitted = re.compile(r"averaging group \d+ is \[0, 1, 2\], admitting \[2\]")
        wait_for(lambda: admitted.search(rank_logs(run)) is not None, job, what="rank 2 was admitted")
        full = finish(joiner(tmp_path), 60)  # every seat taken: refused, naming the key
        assert full.code == 2 and "launch.max_ranks=3" in full.out, full.out
        pid = int(re.search(r"rank 2/2 \(pid (\d+)\)", (run / "rank2.log").read_text()).group(1))  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        dead = finish(joiners[0], 60)
        assert dead.code == 1 and "rank 2 left the run before its end (signal SIGKILL)" in dead.out, dead.out
        joiners.append(joiner(tmp_path))
        result = finish(job, 240)
        assert finish(joiners[1], 60).code == 0
    finally:
        kill_left([job, *joiners])
    result.check()
    events = [(e["event"], e["rank"]) for e in membership(run)]
    assert events == [("rank_admitted", 2), ("rank_cut", 2), ("rank_admitted", 2)], events
    cut = next(e for e in membership(run) if e["event"] == "rank_cut")
    assert cut["why"] == "its process ended: signal SIGKILL", cut  # posted by flodl-join: no heartbeat waited
    check_every_epoch_once(run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["world"] == 3


def test_a_job_hosted_by_flodl_coordinator_takes_a_joiner_the_several_hosts_way(tmp_path: Path) -> None:
    """flodl-coordinator hosts the store and the run; two ranks are started by hand (RANK / WORLD_SIZE /
    MASTER_*), and a third joins with flodl-join, which reads where the store listens from the card."""
    port = free_port()
    overrides = [
        FAST_START,
        "fault_tolerance=survive",
        RUN,
        "policy=cadence",
        f"epochs={EPOCHS_AT_MOST}",
        "batch_size=8",
        "eval_every=0",
        "launch.max_ranks=3",
        GROWN.replace("world:4", "world:3"),
    ]
    job_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    host = start([str(Path(PYTHON).parent / "flodl-coordinator"), *overrides], tmp_path, child_env(**job_env))
    ranks = [
        start([PYTHON, TRAIN, *overrides], tmp_path, child_env(RANK=str(r), **job_env), subprocess.DEVNULL)
        for r in range(2)
    ]
    run = tmp_path / "run"
    joiners: list[Child] = []
    try:
        wait_for((run / CARD).is_file, host, what="the coordinator wrote its join card")
        joiners.append(joiner(tmp_path))
        hosted = finish(host, 240)
        codes = [p.wait(timeout=60) for p in [*ranks, *joiners]]
    finally:
        kill_left([host, *ranks, *joiners])
    assert hosted.code == 0 and codes == [0, 0, 0], (codes, hosted.out[-3000:])
    assert [(e["event"], e["rank"]) for e in membership(run)] == [("rank_admitted", 2)]
    check_every_epoch_once(run)
    final = digests(rank_logs(run), "final round")
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final


def test_a_joiner_started_anywhere_imports_the_users_task_and_the_grown_job_ends(tmp_path: Path) -> None:
    """A job of a user's own project (its package and conf/, run from its dir with the installed command); a
    joiner started in / imports the user's package as the job's ranks did (the card's sys.path and working
    dir), is admitted, and the grown job ends cleanly (its task has no eval data: the stop's last epoch asks
    no eval of it). Where the package does not import (a host without the project), the joiner says so in one
    line naming the module, before it takes a seat."""
    project = write_project(tmp_path)
    command = [str(Path(PYTHON).parent / "flodl-train"), "--config-dir", "conf", "task=blobs"]
    survive = ["fault_tolerance=survive", "launch.nproc_per_node=2", "launch.max_ranks=3", FAST_START]
    grown = GROWN.replace("world:4", "world:3")
    job = start([*command, *survive, "policy=cadence", f"epochs={EPOCHS_AT_MOST}", grown, RUN], project)
    run = project / "run"
    trained = run / "metrics.jsonl"
    joined: Child | None = None
    try:
        # An epoch recorded: the job's ranks imported mypkg.
        wait_for(lambda: trained.is_file() and trained.read_text().strip() != "", job, what="an epoch")
        (project / "mypkg").rename(project / "away")
        refused = finish(joiner(tmp_path, Path("/")), 60)
        (project / "away").rename(project / "mypkg")
        joined = joiner(tmp_path, Path("/"))  # the job's one seat past its start: the refused one took none
        result = finish(job, 240)
        code = finish(joined, 60).code
    finally:
        for proc in [job, joined]:
            if proc is not None and proc.poll() is None:
                kill_group(proc)
    result.check()
    assert code == 0, code
    assert "rank 2: state after admitting [2]" in (run / "rank2.log").read_text()
    assert [(e["event"], e["rank"]) for e in membership(run)] == [("rank_admitted", 2)]
    assert check_every_epoch_once(run)[-1]["world"] == 3
    (line,) = refused.out.strip().splitlines()
    assert refused.code == 2 and line.startswith(f"flodl: no rank joins the job in {run} from here: "), line
    assert "task.model._target_='mypkg.parts.Net': does not import" in line, line
    assert "No module named 'mypkg'" in line, line
