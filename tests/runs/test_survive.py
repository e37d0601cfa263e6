"""fault_tolerance=survive end to end: 3 self-launched gloo ranks, one of them killed (in a window, or as it
enters a round) or frozen; the others go on without a restart of their own, every epoch is trained and
reported once, the last round leaves every member with one state, and a restarted rank is admitted back
with the consensus, bit for bit. With min_ranks above the survivors the run ends with an error, its
consensus saved."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import CheckpointDir
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TRAIN,
    Result,
    child_env,
    finish,
    free_port,
    kill_group,
    kill_left,
    start,
    train,
    wait_for,
)
from tests.helpers.survive_runs import (
    EPOCHS_AT_MOST,
    STOP_ONCE_ADMITTED,
    check_every_epoch_once,
    check_sync_epochs,
    digests,
    epoch_records,
    membership,
    rest_lines,
)

pytestmark = pytest.mark.multiproc

COMMON = ("launch.nproc_per_node=3", FAST_START, "fault_tolerance=survive", "hydra.run.dir=run")
# A rank that exits is cut at once (its supervisor says so); one that is frozen, or has no supervisor (ranks
# started one by one), after the heartbeat timeout: short here.
QUICK_HEARTBEAT = "heartbeat_timeout_s=2"
# The cut of a rank whose process ended, as its supervisor saw it.
EXITED = "its process ended: signal SIGKILL"


def survive_run(
    tmp_path: Path, epochs: int, batch_size: int, *overrides: str, apart: bool = False
) -> tuple[Result, Path]:
    result = train(
        *COMMON,
        f"epochs={epochs}",
        f"batch_size={batch_size}",
        *overrides,
        cwd=tmp_path,
        timeout=240,
        apart=apart,
    )
    return result, tmp_path / "run"


def pids(out: str) -> dict[int, list[int]]:
    """Each rank's processes, in the order they started (a rank's start line names its pid)."""
    seen: dict[int, list[int]] = defaultdict(list)
    for rank, pid in re.findall(r"\] rank (\d+)/\d+ \(pid (\d+)\)", out):
        seen[int(rank)].append(int(pid))
    return seen


def admitted_optimizers(out: str) -> dict[int, tuple[str, str]]:
    """Each rank's optimizer fingerprint and learning rate, as it logged them after an admission."""
    found = re.findall(r"rank (\d+): state after admitting [^\n]*, optimizer ([0-9a-f]+), lr (\S+)", out)
    return {int(rank): (digest, lr) for rank, digest, lr in found}


# async on the cpu backend: the round runs on a thread while the ranks train on, and is cut there. With an
# outer optimizer and a delta wire, the cut round's outer step, reference and feedback go back too, and the
# joiner takes the members' outer state: the digests below would differ otherwise.
@pytest.mark.parametrize(
    ("policy", "kill_in", "backend", "averaging"),
    [
        ("cadence", "window", "nccl", ()),
        ("async", "round", "cpu", ()),
        ("cadence", "round", "nccl", ("outer=diloco", "quantized_wire=int8")),
        ("async", "round", "cpu", ("outer=slowmo", "bf16_wire=true")),
    ],
    ids=[
        "cadence-window",
        "async-round-cpu-backend",
        "cadence-round-diloco-int8",
        "async-round-cpu-slowmo-bf16",
    ],
)
def test_a_killed_rank_is_cut_out_restarted_and_admitted_back(
    tmp_path: Path, policy: str, kill_in: str, backend: str, averaging: tuple[str, ...]
) -> None:
    result, run = survive_run(
        tmp_path,
        EPOCHS_AT_MOST,
        8,
        f"policy={policy}",
        f"backend={backend}",
        *averaging,
        "simulate.kill_rank=1",
        "simulate.kill_at_step=6",
        f"simulate.kill_in={kill_in}",
        "launch.max_restarts=1",
        STOP_ONCE_ADMITTED,
    )
    result.check()
    started = pids(result.out)
    # The survivors never restarted; the killed rank started twice.
    assert len(started[0]) == 1 and len(started[2]) == 1, started
    assert len(started[1]) == 2, started
    records = check_every_epoch_once(run)
    events = membership(run)
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", 1), ("rank_admitted", 1)], events
    assert events[0]["why"] == EXITED, events[0]  # at once, as its supervisor saw it: no heartbeat waited out
    for event in events:
        assert event["first_round_s"] >= event["formed_s"] >= 0
    assert "rank 1 is out" in result.out
    # The admitted rank received the consensus and the global steps: every member held the same right after.
    admitted = digests(result.out, "admitting")
    assert set(admitted) == {0, 1, 2} and len(set(admitted.values())) == 1, admitted
    # And the sharer's optimizer (rank 0, the first member: its Adam moments), not a fresh one; every member's
    # learning rate the same (a joiner's schedule on the global clock).
    optimizers = admitted_optimizers(result.out)
    assert set(optimizers) == {0, 1, 2} and optimizers[1] == optimizers[0], optimizers
    assert len({lr for _, lr in optimizers.values()}) == 1, optimizers
    # The last round was exact: one state on every member, and model.pt is it.
    final = digests(result.out, "final round")
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final
    assert torch.load(run / "model.pt", weights_only=True)
    worlds = [r["world"] for r in records]
    assert min(worlds) <= 3 and worlds[-1] == 3, worlds


# digits with 3 ranks of 8: 59 steps an epoch. Sync's rank 0 dies in the first step of the second epoch,
# where the members agree they stand at the end of the first: none of the cut epoch was trained.
@pytest.mark.parametrize(("policy", "kill_at"), [("sync", 60), ("cadence", 6), ("async", 6)])
def test_rank_0_dies_and_comes_back_like_any_rank(tmp_path: Path, policy: str, kill_at: int) -> None:
    """The run's records live in the launcher's process (its host), not in rank 0: rank 0 killed mid-run is
    cut at once, the others train on (checkpoints keep being committed), and its restart is admitted."""
    result, run = survive_run(
        tmp_path,
        EPOCHS_AT_MOST,
        8,
        f"policy={policy}",
        "simulate.kill_rank=0",
        f"simulate.kill_at_step={kill_at}",
        "launch.max_restarts=1",
        "checkpoint_every=1",
        STOP_ONCE_ADMITTED,
    )
    result.check()
    started = pids(result.out)
    assert len(started[0]) == 2 and len(started[1]) == 1 and len(started[2]) == 1, started
    events = membership(run)
    assert [(e["event"], e["rank"], e.get("why")) for e in events][:1] == [("rank_cut", 0, EXITED)], events
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", 0), ("rank_admitted", 0)], events
    records = epoch_records(run, None)
    cut_epoch = next(r["epoch"] for r in records if r["membership"])
    assert CheckpointDir(run, 2).latest().epoch >= cut_epoch  # committed after rank 0 died
    if policy != "sync":  # the members' state went to rank 0, not rank 0's fresh one to them
        admitted = digests(result.out, "admitting")
        assert set(admitted) == {0, 1, 2} and len(set(admitted.values())) == 1, admitted
        assert int(admitted[0].split("global steps ")[1]) > 0, admitted
    end = "the last epoch" if policy == "sync" else "final round"
    final = digests(result.out, end)
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final
    assert torch.load(run / "model.pt", weights_only=True)


def test_a_frozen_rank_is_cut_the_rest_finish_and_resume_after_it(tmp_path: Path) -> None:
    frozen = ("policy=cadence", "simulate.hang_rank=2", "simulate.hang_at_step=5", "checkpoint_every=1")
    result, run = survive_run(tmp_path, 4, 32, *frozen, QUICK_HEARTBEAT, "launch.max_restarts=0")
    result.check()
    started = pids(result.out)
    assert all(len(started[r]) == 1 for r in range(3)), started
    check_every_epoch_once(run, 4)
    events = membership(run)
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", 2)], events
    assert "no heartbeat" in events[0]["why"]
    final = digests(result.out, "final round")
    assert set(final) == {0, 1} and len(set(final.values())) == 1, final
    # Said once, at the end: not after each checkpoint's exact round.
    said = re.findall(r"rank (\d+): state after final round", result.out)
    assert sorted(said) == ["0", "1"], said
    # The last checkpoint holds the members' parts; resumed with every rank, the one without a part starts
    # from the consensus with a fresh optimizer, and the run goes on.
    manifest = json.loads((run / "checkpoints" / "epoch-000004" / "manifest.json").read_text())
    assert manifest["ranks"] == [0, 1]
    resumed, run = survive_run(tmp_path, 5, 32, "policy=cadence", "checkpoint_every=1")
    resumed.check()
    assert "rank 2 has no part in" in resumed.out
    check_every_epoch_once(run, 5)


# What each policy says of every member's state at the end: local SGD's exact last round, sync's last epoch.
@pytest.mark.parametrize(("policy", "end"), [("cadence", "final round"), ("sync", "the last epoch")])
def test_too_few_ranks_left_stops_with_the_consensus_saved(tmp_path: Path, policy: str, end: str) -> None:
    result, run = survive_run(
        tmp_path,
        4,
        32,
        f"policy={policy}",
        "simulate.kill_rank=1",
        "simulate.kill_at_step=4",
        "min_ranks=3",
        apart=True,
    )
    assert result.code != 0 and not result.timed_out, result.out[-4000:]
    # A planned stop, in one line naming min_ranks: no traceback, no "rank 0 failed".
    lines = result.err.strip().splitlines()
    planned = f"flodl: only 2 rank(s) left ([0, 2]) after rank 1 was cut ({EXITED})"
    assert len(lines) == 1 and lines[0].startswith(planned), result.err[-6000:]
    assert "min_ranks=3" in lines[0] and f"consensus is saved as {run / 'model.pt'}" in lines[0], lines[0]
    assert "Traceback" not in result.out and "failed" not in lines[0], result.out[-4000:]
    assert (run / "model.pt").is_file()
    final = digests(result.out, end)
    assert set(final) == {0, 2} and len(set(final.values())) == 1, final


def test_ranks_started_one_by_one_beside_flodl_coordinator_survive_rank_0_dying(tmp_path: Path) -> None:
    """The several-hosts way: flodl-coordinator started first (it hosts the store and the run), then each
    rank its own process with RANK / WORLD_SIZE / MASTER_* (no torchrun, no supervisor). Rank 0 dies like any
    rank: the others train on, and the test, as rank 0's restart loop, starts it again. No supervisor reaps
    it, yet it is cut for its death, not for its silence (a minute's heartbeat timeout) nor for its restart:
    its connection to the run's host closed with it (flodl/links/liveness.py)."""
    port = free_port()
    overrides = [
        *COMMON[2:],
        "heartbeat_timeout_s=60",
        "policy=cadence",
        f"epochs={EPOCHS_AT_MOST}",
        "batch_size=8",
        "simulate.kill_rank=0",
        "simulate.kill_at_step=4",
        STOP_ONCE_ADMITTED,
        "eval_every=0",
    ]
    job = {"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    coordinator = start(
        [str(Path(PYTHON).parent / "flodl-coordinator"), *overrides], tmp_path, child_env(**job)
    )

    def rank(r: int) -> subprocess.Popen:
        return start([PYTHON, TRAIN, *overrides], tmp_path, child_env(RANK=str(r), **job), subprocess.DEVNULL)

    procs = [rank(r) for r in range(3)]
    restarted = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and coordinator.poll() is None:
            if restarted is None and procs[0].poll() is not None:
                assert procs[0].returncode == -signal.SIGKILL, procs[0].returncode
                restarted = rank(0)
            time.sleep(0.2)
        hosted = finish(coordinator, 30)
        codes = [p.wait(timeout=30) for p in procs[1:]]
        assert restarted is not None, "rank 0 was never killed"
        assert restarted.wait(timeout=60) == 0
    finally:
        kill_left([coordinator, *procs, *([restarted] if restarted else [])])
    assert hosted.code == 0 and codes == [0, 0], (codes, hosted.out[-3000:])
    run = tmp_path / "run"
    check_every_epoch_once(run)
    events = membership(run)
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", 0), ("rank_admitted", 0)], events
    assert events[0]["why"] == "its process ended: its connection to the run's host closed", events[0]
    assert "[coordinator] rank 0 is out" in hosted.out
    log = "".join((run / f"rank{r}.log").read_text() for r in range(3))
    final = digests(log, "final round")
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final
    assert (run / "model.pt").is_file()


def test_a_rank_dying_while_the_ranks_start_is_cut_and_the_others_share_a_start(tmp_path: Path) -> None:
    result, run = survive_run(
        tmp_path,
        3,
        32,
        "policy=async",
        "simulate.kill_rank=2",
        "simulate.kill_at_step=1",
        "simulate.kill_in=start",
    )
    result.check()
    check_every_epoch_once(run, 3)
    assert [(e["event"], e["rank"], e["why"]) for e in membership(run)] == [("rank_cut", 2, EXITED)]
    final = digests(result.out, "final round")
    assert set(final) == {0, 1} and len(set(final.values())) == 1, final


def test_a_rank_killed_before_its_first_word_to_the_host_is_started_again(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed at its log's first line, before it told the run's host what it sees of the
    checkpoint dir (spawned: its imports leave the time): the supervisor starts it again, and the run finishes
    with it admitted. The host's wait for that word once held the store client the supervisor polls for
    cuts, so the dead rank was never reaped nor restarted, and the run failed a timeout later."""
    args = [PYTHON, TRAIN, "launch.nproc_per_node=2", "launch.start_method=spawn", "fault_tolerance=survive"]
    args += ["hydra.run.dir=run", "launch.max_restarts=1", "launch.timeout_s=60", "epochs=3", "batch_size=32"]
    proc = start(args, cwd=tmp_path)
    log = tmp_path / "run" / "rank1.log"
    first = re.compile(r"rank 1/2 \(pid (\d+)\)")
    try:
        wait_for(
            lambda: log.is_file() and first.search(log.read_text()) is not None, proc, what="rank 1 started"
        )
        os.kill(int(first.search(log.read_text()).group(1)), signal.SIGKILL)  # type: ignore[union-attr]
        result = finish(proc, 200)
    finally:
        kill_group(proc)
    result.check()
    check_every_epoch_once(tmp_path / "run", 3)
    assert [(e["event"], e["rank"]) for e in membership(tmp_path / "run")] == [
        ("rank_cut", 1),
        ("rank_admitted", 1),
    ]


# --- policy=sync: DDP re-wrapped on each group, the rest of a cut epoch planned again -------------------


# bf16_wire: each new group's DDP sends its buckets as bf16 through survive's own waiting hook.
@pytest.mark.parametrize("wire", [(), ("bf16_wire=true",)], ids=["fp32", "bf16"])
def test_sync_a_killed_rank_is_cut_its_rest_planned_again_and_it_heals_back(
    tmp_path: Path, wire: tuple[str, ...]
) -> None:
    batch = 8
    result, run = survive_run(
        tmp_path,
        EPOCHS_AT_MOST,
        batch,
        "policy=sync",
        *wire,
        "simulate.kill_rank=1",
        "simulate.kill_at_step=6",
        "launch.max_restarts=1",
        STOP_ONCE_ADMITTED,
    )
    result.check()
    started = pids(result.out)
    assert len(started[0]) == 1 and len(started[2]) == 1 and len(started[1]) == 2, started
    events = membership(run)
    assert [(e["event"], e["rank"]) for e in events] == [("rank_cut", 1), ("rank_admitted", 1)], events
    assert events[0]["why"] == EXITED, events[0]  # at once, as its supervisor saw it: no heartbeat waited out
    for event in events:
        assert event["first_round_s"] >= event["formed_s"] >= 0
    records, whole = check_sync_epochs(run)
    # Rank 1 died in its 6th step: the survivors had trained 5 steps of epoch 0 with it, and share the rest.
    (replanned,) = rest_lines(result.out)
    epoch, trained, members, rest, dropped = replanned
    assert (epoch, trained, members) == (1, 5, [0, 2]), replanned  # the first epoch, as lines count
    cut = records[0]
    assert cut["steps_taken"] == trained + rest
    assert cut["samples"] == 2 * (trained + rest) * batch  # what the survivors report
    assert (3 * trained + 2 * rest) * batch + dropped == whole, "every pick of the epoch but the dropped"
    assert dropped < 2 * batch
    # The world shrank and grew back, and the learning rate followed it (lr_scale_ratio=1: x(1 + (n - 1))).
    worlds = [r["world"] for r in records]
    assert worlds[0] == 2 and worlds[-1] == 3, worlds
    assert records[0]["lr"] == pytest.approx(records[-1]["lr"] * 2 / 3)
    assert "world 3 -> 2: global batch 16, learning rate x0.6667" in result.out
    # The restarted rank received the members' state: every member held the same right after, and at the end.
    admitted = digests(result.out, r"admitting \[1\]")
    assert set(admitted) == {0, 1, 2} and len(set(admitted.values())) == 1, admitted
    final = digests(result.out, "the last epoch")
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final


def test_sync_a_frozen_rank_is_cut_and_a_resume_hands_it_the_members_optimizer(tmp_path: Path) -> None:
    frozen = ("policy=sync", "simulate.hang_rank=2", "simulate.hang_at_step=5", "checkpoint_every=1")
    result, run = survive_run(tmp_path, 3, 32, *frozen, QUICK_HEARTBEAT, "launch.max_restarts=0")
    result.check()
    assert all(len(ranks) == 1 for ranks in pids(result.out).values())
    assert [(e["event"], e["rank"]) for e in membership(run)] == [("rank_cut", 2)]
    check_sync_epochs(run, 3)
    final = digests(result.out, "the last epoch")
    assert set(final) == {0, 1} and len(set(final.values())) == 1, final
    manifest = json.loads((run / "checkpoints" / "epoch-000003" / "manifest.json").read_text())
    assert manifest["ranks"] == [0, 1]
    # Resumed with every rank: rank 2 has no part and takes rank 0's optimizer (DDP steps them all alike:
    # a fresh one would drift from the others), so all three end with one state.
    two = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed, run = survive_run(tmp_path, 4, 32, "policy=sync", "checkpoint_every=1")
    resumed.check()
    assert "rank 2 has no part in" in resumed.out and "rank 0's optimizer state" in resumed.out
    # The checkpoint's learning rate was scaled for 2 ranks; resumed with 3, it is scaled for 3.
    three = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert three[-1]["lr"] == pytest.approx(two[-1]["lr"] * 3 / 2)
    final = digests(resumed.out, "the last epoch")
    assert set(final) == {0, 1, 2} and len(set(final.values())) == 1, final
