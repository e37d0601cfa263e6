"""Run dirs, run identity, the metrics file and the closed rendezvous, one function at a time (real files,
real stores, real processes where a pid must be alive or dead)."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from flodl.checkpoints.disk import Checkpoint, CheckpointDir, CheckpointError
from flodl.checkpoints.identity import check_identity, run_identity
from flodl.config.host import user_temp_dir
from flodl.data.pack import _HOST, remove_stale
from flodl.job.resume import prepare_history, truncate_history
from flodl.launcher.run_dir import RunDirTaken, agreed_run_stamp, claim_stamp
from flodl.links.group import loopback_store
from flodl.metrics.sinks import read_history, record_line

CONFIG = {"policy": "sync", "seed": 1, "batch_size": 32, "epochs": 4, "task": {"name": "digits"}}


def test_two_claims_in_the_same_second_get_two_dirs(tmp_path: Path) -> None:
    first, second = claim_stamp(tmp_path), claim_stamp(tmp_path)
    assert first != second
    assert (tmp_path / first).is_dir() and (tmp_path / second).is_dir()


def test_a_stamp_from_the_store_must_be_a_stamp_before_it_becomes_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = loopback_store(0, None, timedelta(seconds=10))
    for key, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_RUN_ID": "r",
    }.items():
        monkeypatch.setenv(key, value)
    store.set(f"flodl/run_stamp/{tmp_path}/r", "../../../etc")
    with pytest.raises(
        RunDirTaken, match=r"'\.\./\.\./\.\./etc' from the rendezvous store is not a flodl stamp"
    ):
        agreed_run_stamp(str(tmp_path), "RUN", "RUN")
    store.set(f"flodl/run_stamp/{tmp_path}/r", "2026-01-02/03-04-05-1")
    assert agreed_run_stamp(str(tmp_path), "RUN", "RUN") == "2026-01-02/03-04-05-1"


def test_resume_auto_takes_its_own_run_and_its_own_config_and_refuses_another_saying_why(
    tmp_path: Path,
) -> None:
    theirs = run_identity(CONFIG, "uid-a")
    checkpoint = Checkpoint(tmp_path, 3, 2, theirs)
    check_identity(checkpoint, run_identity({**CONFIG, "epochs": 9}, "uid-b"), "auto")  # same config
    check_identity(checkpoint, run_identity({**CONFIG, "seed": 2}, "uid-a"), "auto")  # a restart
    with pytest.raises(CheckpointError, match=r"belongs to run uid-a.*seed: 1 there, 2 here.*resume=never"):
        check_identity(checkpoint, run_identity({**CONFIG, "seed": 2}, "uid-b"), "auto")
    # Another world size is the same experiment (flodl/job/resize.py), as an older manifest said it too.
    check_identity(checkpoint, run_identity(CONFIG, "uid-b"), str(tmp_path))
    older = {**theirs, "config": {**theirs["config"], "world_size": 2}, "config_sha256": "older"}
    check_identity(Checkpoint(tmp_path, 3, 2, older), run_identity(CONFIG, "uid-b"), "auto")
    with pytest.raises(CheckpointError, match="does not record the run that wrote it"):
        check_identity(Checkpoint(tmp_path, 3, 2, None), theirs, "auto")


def test_a_record_with_nan_is_strict_json_that_says_where(tmp_path: Path) -> None:
    line = record_line({"epoch": 1, "loss": float("nan"), "per_rank": [{"loss": float("inf")}]})
    assert json.loads(line) == {
        "epoch": 1,
        "loss": None,
        "per_rank": [{"loss": None}],
        "nonfinite": ["loss", "per_rank.0.loss"],
    }


def test_history_keeps_each_covered_epoch_once_and_drops_a_torn_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [{"epoch": e, "loss": 0.1 * (e + 1)} for e in (0, 1, 0, 1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"epoch": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="flodl"):
        truncate_history(path, through_epoch=1)
    assert "line 6 dropped" in caplog.text
    assert path.read_text().splitlines() == [json.dumps(records[2]), json.dumps(records[3])]
    assert [r["epoch"] for r in read_history(path)] == [0, 1]


def test_a_fresh_start_moves_the_earlier_history_aside(tmp_path: Path) -> None:
    metrics, store = tmp_path / "metrics.jsonl", CheckpointDir(tmp_path, keep=2)
    for n in (1, 2):
        metrics.write_text('{"epoch": 0}\n')
        store.root.mkdir()
        prepare_history(metrics, store, None)
        assert not metrics.exists() and not store.root.exists()
        assert (tmp_path / f"metrics.jsonl.superseded-{n}").is_file()
        assert (tmp_path / f"checkpoints.superseded-{n}").is_dir()


def test_stale_stage_files_are_judged_by_the_host_that_wrote_them(tmp_path: Path) -> None:
    dead = 2**22 + 1  # above pid_max's default: no process has it
    mine = tmp_path / f"flodl-stage-{_HOST}-{dead}-0.pack"
    other_host = tmp_path / f"flodl-stage-elsewhere-{dead}-0.pack"
    for path in (mine, other_host):
        path.write_bytes(b"x")
    assert remove_stale(tmp_path, alive=lambda pid: False) == [mine]
    assert other_host.exists()


def test_generated_data_lives_in_a_private_per_user_dir() -> None:
    path = user_temp_dir()
    assert path.name == f"flodl-{os.getuid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_flodl_s_own_store_cannot_be_reached_from_another_address() -> None:
    address = next(
        (
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        ),
        None,
    )
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    store = loopback_store(0, None, timedelta(seconds=10))
    socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, store.port), timeout=5)
