"""One run, one dir; each epoch once in metrics.jsonl; a single-host job's sockets stay on loopback.

Real processes, real files: runs started together, killed, restarted over corrupt checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from flodl.checkpoints.disk import CheckpointDir
from tests.helpers.procs import FAST_START, PYTHON, TRAIN, Result, finish, kill_group, start, train
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

RUN = ("epochs=2", "checkpoint_every=1")


def strict_epochs(run_dir: Path) -> list[int]:
    return [record["epoch"] for record in epochs_of(run_dir)]


def launch(*overrides: str, cwd: Path) -> subprocess.Popen:
    return start([PYTHON, TRAIN, *overrides], cwd)


def done(proc: subprocess.Popen) -> Result:
    result = finish(proc, timeout=240)
    assert not result.timed_out, result.out[-3000:]
    return result


def manifest_runs(run_dir: Path) -> list[dict]:
    return [json.loads(m.read_text())["run"] for m in (run_dir / "checkpoints").glob("epoch-*/manifest.json")]


def test_two_runs_started_together_each_train_their_own_seed_in_their_own_dir(tmp_path: Path) -> None:
    jobs = {seed: launch(*RUN, f"seed={seed}", cwd=tmp_path) for seed in (1, 2)}
    results = {seed: done(proc) for seed, proc in jobs.items()}
    for result in results.values():
        result.check()
    run_dirs = sorted(p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl"))
    assert len(run_dirs) == 2, run_dirs
    seen = set()
    for run_dir in run_dirs:
        seed = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["seed"]
        seen.add(seed)
        assert strict_epochs(run_dir) == [0, 1]
        runs = manifest_runs(run_dir)
        assert len(runs) == 2 and {r["config"]["seed"] for r in runs} == {seed}
        assert len({r["uid"] for r in runs}) == 1
        assert "resumed from" not in results[seed].out
    assert seen == {1, 2}


def test_a_second_run_into_a_taken_explicit_dir_is_refused_and_the_owner_resumes_only_itself(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    jobs = {seed: launch(*RUN, f"seed={seed}", f"hydra.run.dir={run_dir}", cwd=tmp_path) for seed in (1, 2)}
    results = {seed: done(proc) for seed, proc in jobs.items()}
    codes = sorted(r.code for r in results.values())
    assert codes == [0, 2], {s: r.out[-3000:] for s, r in results.items()}
    winner = next(s for s, r in results.items() if r.code == 0)
    loser = results[3 - winner]
    # Refused before training: while the owner runs, or (if it already ended) at its checkpoint.
    assert "Traceback" not in loser.out
    assert f"run dir {run_dir} belongs to run" in loser.out or f"(seed: {winner} there" in loser.out
    assert strict_epochs(run_dir) == [0, 1]
    assert {r["config"]["seed"] for r in manifest_runs(run_dir)} == {winner}
    # The same experiment, launched again into its dir, continues; another seed is refused, saying why.
    more = train("epochs=3", "checkpoint_every=1", f"seed={winner}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "training continues at epoch 3" in more.check().out  # the checkpoint after epoch 2 (from 1)
    assert strict_epochs(run_dir) == [0, 1, 2]
    other = train(*RUN, f"seed={3 - winner}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert other.code == 2 and "Traceback" not in other.out
    assert f"seed: {winner} there, {3 - winner} here" in other.out and "resume=never" in other.out


def _corrupt_every_checkpoint(run_dir: Path) -> None:
    for model in (run_dir / "checkpoints").glob("epoch-*/model.pt"):
        model.write_bytes(model.read_bytes()[:-16])


def test_metrics_hold_each_epoch_once_whatever_came_before(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    here = f"hydra.run.dir={run_dir}"
    # Killed after its first epoch, before its first checkpoint (after epoch 2) was committed: the restart
    # starts over. The coordinator is held once it has written the first record (nothing commits after it).
    hold = "callbacks=[{_target_:tests.helpers.callback_log.HoldAfterFirstEpoch}]"
    proc = launch("epochs=3", "checkpoint_every=2", hold, here, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "first-epoch-recorded").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        assert strict_epochs(run_dir) == [0]
        assert CheckpointDir(run_dir, 1).latest() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: no clean-up of any kind
        kill_group(proc)
    train(*RUN, here, cwd=tmp_path).check()
    assert strict_epochs(run_dir) == [0, 1]
    # A torn last line (a crash mid-write): dropped with a warning, the run resumes.
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"epoch": 2, "loss": 0.')
    resumed = train("epochs=3", "checkpoint_every=1", here, cwd=tmp_path).check()
    assert "metrics.jsonl line 3 dropped" in resumed.out
    assert "training continues at epoch 3" in resumed.out
    assert strict_epochs(run_dir) == [0, 1, 2]
    # Every checkpoint corrupt: the run starts over, its earlier history moved aside.
    _corrupt_every_checkpoint(run_dir)
    train(*RUN, here, cwd=tmp_path).check()
    assert strict_epochs(run_dir) == [0, 1]
    assert (run_dir / "metrics.jsonl.superseded-2").is_file()
    # resume=never in a dir with history.
    train(*RUN, "resume=never", here, cwd=tmp_path).check()
    assert strict_epochs(run_dir) == [0, 1]
    assert (run_dir / "checkpoints.superseded-3").is_dir()


def _non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


def _listening(proc: subprocess.Popen) -> list[tuple[int, str, int]]:
    found = []
    for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            found += [
                (process.pid, c.laddr.ip, c.laddr.port)
                for c in process.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_single_host_job_listens_on_loopback_only(tmp_path: Path, nproc: int) -> None:
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    run_dir = tmp_path / "run"
    last = f"rank{nproc - 1}.log"
    proc = launch(
        f"launch.nproc_per_node={nproc}",
        FAST_START,  # the ranks' sockets are theirs however they were started
        "policy=cadence",
        "epochs=4",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / last).is_file() or "master port" not in (run_dir / last).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        sockets = _listening(proc)
        assert sockets, "no listening socket found: the store must be somewhere"
        assert all(ip == "127.0.0.1" for _, ip, _ in sockets), sockets
        for _, _, port in sockets:  # from this machine's other address, nobody answers
            with pytest.raises(ConnectionRefusedError), socket.create_connection((address, port), timeout=5):
                pass
        assert proc.poll() is None, "the job ended before its sockets were tried: make it longer"
    finally:
        result = done(proc)
    result.check()
