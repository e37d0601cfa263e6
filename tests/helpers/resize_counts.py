"""Every sample once across a resize, counted: the samples a checkpoint of tests/helpers/conf/task/byo_points
had trained in its epoch (from its coordinator state), and the reads the resumed run's Dataset logged."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from flodl.data.partition import epoch_permutation
from tests.helpers.byo_data import reads
from tests.helpers.procs import FAST_START, REPO

SAMPLES = 192  # byo_points' training set: 12 batches of 16 an epoch
# The task, its checkpoints all kept (a test resumes from one inside an epoch), ranks forked where they may.
CONF = str(REPO / "tests" / "helpers" / "conf")
POINTS = ("--config-dir", CONF, "task=byo_points", "checkpoint_keep=50", FAST_START)
# ElChe's windows pinned at 2 steps: a local-SGD checkpoint inside an epoch comes at a known place.
PINNED = ("anchor=2", "min_anchor=2", "max_anchor=2", "max_batch_diff=0")


def resumable(run_dir: Path, shown_epoch: int) -> Path:
    """The first checkpoint `run_dir` took inside its epoch `shown_epoch` (as lines count)."""
    found = sorted((run_dir / "checkpoints").glob(f"epoch-{shown_epoch:06d}-sample-*"))
    assert found, f"no checkpoint inside epoch {shown_epoch}: {sorted((run_dir / 'checkpoints').iterdir())}"
    return found[0]


def read(log: Path) -> Counter[int]:
    counted: Counter[int] = Counter()
    for process in reads(log):
        counted.update({i: len(v) for i, v in process.items()})
    return counted


def trained_before(checkpoint: Path) -> tuple[int, Counter[int]]:
    """The checkpoint's epoch, and the samples of it trained before the checkpoint: under sync every pick
    but the rest its driver recorded, under local SGD the slices its record's chunks trained. A checkpoint
    after an epoch: the next one, none of it trained."""
    state = torch.load(checkpoint / "coordinator.pt", weights_only=True)
    if state["into"] is None:
        return state["epoch"] + 1, Counter()
    order = epoch_permutation(SAMPLES, 42, state["epoch"])  # the default seed
    rest = state["driver"].get("rest")
    if rest is not None:
        left = {
            p
            for _, pieces in rest["shares"]
            for s in pieces
            for p in range(s["offset"], s["offset"] + s["size"])
        }
        trained = Counter(int(order[p]) for p in range(SAMPLES) if p not in left)
    else:
        chunks = state["ledger"]["chunks"]
        trained = Counter(int(i) for c in chunks for i in order[c["offset"] : c["offset"] + c["samples"]])
    assert sum(trained.values()) == state["into"] and max(trained.values()) == 1
    return state["epoch"], trained


def resumed_trains_each_sample_once_an_epoch(checkpoint: Path, log: Path, epochs: int) -> None:
    epoch, trained = trained_before(checkpoint)
    after = read(log)
    assert {i: trained[i] + after[i] for i in range(SAMPLES)} == {i: epochs - epoch for i in range(SAMPLES)}
