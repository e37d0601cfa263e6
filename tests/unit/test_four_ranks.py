"""The N-rank code paths with 4 ranks (what a 4-GPU host runs): election, counts, weights, barriers; in one
process (tests/helpers/in_process.py), the ranks threads over gloo groups of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.in_process import run_in_process


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_four_ranks_with_one_slowed_balance_and_checkpoint(tmp_path: Path, policy: str) -> None:
    slowed = ("simulate.slow_rank=3", "simulate.factor=3")
    run = run_in_process(
        tmp_path / "run",
        4,
        f"policy={policy}",
        *slowed,
        "epochs=6",
        "checkpoint_every=3",
        "logger.log_every=0",
    )
    assert [end.error for end in run.ranks] == [None] * 4, run.log[-3000:]
    records = run.records
    assert [r["epoch"] for r in records] == list(range(6))
    later = records[2:]  # after ElChe's calibration
    batches = [sum(r["per_rank"][rank]["batches"] for r in later) for rank in range(4)]
    # The slowed rank trains the least, clearly less than the fast ranks' mean (the 4 ranks share one
    # interpreter and 2 CPU cores, so the fast ranks' own speeds vary); every batch is trained exactly once.
    assert batches[3] == min(batches) and batches[3] < 0.75 * sum(batches[:3]) / 3, batches
    per_epoch = sum(p["batches"] for p in records[0]["per_rank"])
    assert all(sum(p["batches"] for p in r["per_rank"]) == per_epoch for r in records)
    # Every rank sends the same payload in every round, slow or fast.
    sent = {sum(r["per_rank"][rank]["comm_bytes"] for r in records) for rank in range(4)}
    assert len(sent) == 1 and sent.pop() > 0
    manifest = json.loads((run.run_dir / "checkpoints" / "epoch-000006" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(
        ["model.pt", "coordinator.pt", "rank0.pt", "rank1.pt", "rank2.pt", "rank3.pt"]
    )
    assert records[-1]["eval/accuracy"] > 0.85
