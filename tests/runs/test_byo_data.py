"""Bring your own data, end to end over 2 gloo ranks: a map-style Dataset that augments in __getitem__ is
read afresh every epoch under every policy; dict samples with a custom collate train."""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.byo_data import reads
from tests.helpers.procs import REPO, leftovers, torchrun, train
from tests.helpers.runs import epochs_of, only_run_dir

pytestmark = pytest.mark.multiproc

CONF = str(REPO / "tests" / "helpers" / "conf")
EPOCHS = 3
SAMPLES = 192

DICTS = [
    "+task.train_data.dicts=true",
    "+task.eval_data.dicts=true",
    "+task.collate_fn._target_=tests.helpers.byo_data.dict_collate",
    "+task.collate_fn._partial_=true",
    "task.loss._target_=tests.helpers.byo_data.dict_loss",
    "task.eval_fn._target_=tests.helpers.byo_data.dict_sums",
]


@pytest.mark.parametrize(
    ("policy", "samples", "workers"), [("sync", "tuple", 0), ("cadence", "dict", 0), ("async", "dict", 2)]
)
def test_augmentation_in_getitem_is_fresh_every_epoch(
    tmp_path: Path, policy: str, samples: str, workers: int
):
    log = tmp_path / "reads"
    torchrun(
        2,
        "--config-dir",
        CONF,
        "task=byo_points",
        f"policy={policy}",
        "device=cpu",
        f"epochs={EPOCHS}",
        f"+task.train_data.log={log}",
        *(DICTS if samples == "dict" else []),
        f"num_workers={workers}",
        cwd=tmp_path,
        timeout=240,
    ).check()
    processes = reads(log)
    assert len(processes) == 2 * max(workers, 1)  # each rank read (in its workers, if any)
    counts = Counter(i for seen in processes for i, values in seen.items() for _ in values)
    # Every sample was read from the dataset in every epoch (never served from a cache) ...
    assert sorted(counts) == list(range(SAMPLES))
    assert min(counts.values()) >= EPOCHS, sorted(counts.values())[:10]
    # ... and each read drew new noise: its batch's own stream, whichever rank or worker read it.
    values = [v for seen in processes for sample in seen.values() for v in sample]
    assert len(set(values)) == len(values)
    last = epochs_of(only_run_dir(tmp_path / "outputs"))[-1]
    assert last["epoch"] == EPOCHS - 1 and last["eval/accuracy"] > 0.9, last


def test_a_cacheable_dict_dataset_is_read_once_per_rank_and_trains_through_the_disk_tier(tmp_path: Path):
    log, stage = tmp_path / "reads", tmp_path / "stage"
    stage.mkdir()
    torchrun(
        2,
        "--config-dir",
        CONF,
        "task=byo_points",
        "policy=sync",
        "device=cpu",
        f"epochs={EPOCHS}",
        f"+task.train_data.log={log}",
        *DICTS,
        "task.cacheable=true",
        "ram_max_usage=0",  # no RAM tier: every sample goes to the disk pack
        "disk_stage_gb=1",
        f"disk_stage_dir={stage}",
        cwd=tmp_path,
        timeout=240,
    ).check()
    files = list(log.glob("reads-*.txt"))
    assert len(files) == 2  # the two ranks' processes
    for path in files:
        indices = [line.split()[0] for line in path.read_text().splitlines()]
        assert len(indices) == len(set(indices))  # each sample from its source at most once per rank
    epochs = epochs_of(only_run_dir(tmp_path / "outputs"))
    assert epochs[-1]["scalars"]["data/hits_disk"] > 0, epochs[-1]
    assert epochs[-1]["eval/accuracy"] > 0.9
    assert list(stage.iterdir()) == []  # the pack files are gone


def test_the_data_guides_examples_run_as_written(tmp_path: Path):
    prefix = "python train.py --config-dir docs/examples/conf "
    commands = [
        line for line in (REPO / "docs" / "data.md").read_text().splitlines() if line.startswith(prefix)
    ]
    assert [c.removeprefix(prefix) for c in commands] == ["task=augmented_digits", "task=token_dicts"]
    for command, goal in zip(commands, (0.85, 0.95), strict=True):
        cwd = tmp_path / command.split("=")[-1]
        cwd.mkdir()
        (cwd / "docs").symlink_to(REPO / "docs")  # the relative --config-dir, as from the repo root
        train(*shlex.split(command)[2:], cwd=cwd, timeout=240).check()
        last = epochs_of(only_run_dir(cwd / "outputs"))[-1]
        assert last["eval/accuracy"] >= goal, (command, last)
        assert not leftovers(cwd)  # DataLoader workers included


def test_a_collate_fn_that_does_not_import_stops_the_run_before_any_rank_starts(tmp_path: Path):
    out = train(
        "+task.collate_fn._target_=mypkg.collate",
        "+task.collate_fn._partial_=true",
        cwd=tmp_path,
        timeout=120,
    )
    assert out.code == 2, out.out
    assert "task.collate_fn._target_='mypkg.collate': does not import (ModuleNotFoundError" in out.out
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("rank0.log"))
