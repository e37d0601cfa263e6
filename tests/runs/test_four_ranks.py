"""The N-rank code paths with 4 gloo ranks (what a 4-GPU host runs): election, counts, weights, barriers.

Processes, not the in-process harness: ElChe's balance reads each rank's speed, and ranks that share one
interpreter lock do not run at their own (the slowed rank was not always the slowest there, under load)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.procs import FAST_START, leftovers, train
from tests.helpers.runs import assert_complete_run

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_four_ranks_with_one_slowed_balance_and_checkpoint(tmp_path: Path, policy: str) -> None:
    run_dir = tmp_path / "run"
    train(
        f"policy={policy}",
        "launch.nproc_per_node=4",
        FAST_START,
        "simulate.slow_rank=3",
        "simulate.factor=10",
        "epochs=6",
        "checkpoint_every=3",
        "logger.log_every=0",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=240,
    ).check()
    records = assert_complete_run(run_dir, world=4, epochs=6)
    later = records[2:]  # after ElChe's calibration
    batches = [sum(r["per_rank"][rank]["batches"] for r in later) for rank in range(4)]
    # The slowed rank trains the least, clearly less than the fast ranks' mean; every batch is trained exactly
    # once. The whole run trains for about half a second, and 4 ranks share 2 CPU cores in CI with another
    # test's: at factor 3 a fast rank held off its core that long once trained less than the slowed one
    # ([45, 36, 47, 48]). At factor 10 the slowed rank still gets the probe's and async's overshoot steps.
    assert batches[3] == min(batches) and batches[3] < 0.5 * sum(batches[:3]) / 3, batches
    per_epoch = sum(p["batches"] for p in records[0]["per_rank"])
    assert all(sum(p["batches"] for p in r["per_rank"]) == per_epoch for r in records)
    # Every rank sends the same payload in every round, slow or fast.
    sent = {sum(r["per_rank"][rank]["comm_bytes"] for r in records) for rank in range(4)}
    assert len(sent) == 1 and sent.pop() > 0
    manifest = json.loads((run_dir / "checkpoints" / "epoch-000006" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(
        ["model.pt", "coordinator.pt", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]
    )
    assert records[-1]["eval/accuracy"] > 0.85
    assert not leftovers(tmp_path)
