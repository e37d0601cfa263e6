"""Bring your own data, end to end over 2 gloo ranks: a map-style Dataset that augments in __getitem__ is
read afresh every epoch under every policy; dict samples with a custom collate train."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.byo_data import reads
from tests.procs import REPO, torchrun
from tests.test_cli import epochs_of, only_run_dir

pytestmark = pytest.mark.multiproc

CONF = str(REPO / "tests" / "conf")
EPOCHS = 3
SAMPLES = 192

DICTS = [
    "+task.train_data.dicts=true",
    "+task.eval_data.dicts=true",
    "+task.collate_fn._target_=tests.byo_data.dict_collate",
    "task.loss._target_=tests.byo_data.dict_loss",
    "task.eval_fn._target_=tests.byo_data.dict_sums",
]


@pytest.mark.parametrize(
    ("policy", "samples"), [("sync", "tuple"), ("cadence", "dict"), ("async", "dict")]
)
def test_augmentation_in_getitem_is_fresh_every_epoch(tmp_path: Path, policy: str, samples: str):
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
        cwd=tmp_path,
        timeout=240,
    ).check()
    seen = reads(log)
    # Every sample was read from the dataset in every epoch (never served from a cache) ...
    assert sorted(seen) == list(range(SAMPLES))
    assert min(len(v) for v in seen.values()) >= EPOCHS, sorted(len(v) for v in seen.values())[:10]
    # ... and each read drew new noise.
    assert all(len(set(v)) == len(v) for v in seen.values())
    last = epochs_of(only_run_dir(tmp_path / "outputs"))[-1]
    assert last["epoch"] == EPOCHS - 1 and last["eval/accuracy"] > 0.9, last
