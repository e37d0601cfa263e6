"""bench/plot_suite.py reads the arms table of a suite result, not the ratios table after it."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from gpu_suite import ARMS  # noqa: E402
from plot_suite import arms_table  # noqa: E402

RESULT = """# GPU suite
| arm | samples/s | tokens/s |
|---|---|---|
| plain torch, 1 GPU | 2,806.0 | 718,335 |
| flodl sync | 4,156.7 | 1,064,110 |

| measure | value | goal | verdict |
|---|---|---|---|
| flodl sync / plain DDP | 0.937 | >= 0.98 | **MISSED** |
"""


def test_the_arms_table_is_read_and_the_ratios_are_not() -> None:
    assert arms_table(RESULT) == [("plain torch, 1 GPU", 2806.0), ("flodl sync", 4156.7)]


def test_the_committed_gpt_nano_result_parses() -> None:
    # Results are appended run after run: the last arms table is read, and every row in it is an arm.
    rows = arms_table((REPO / "bench/results/2026-11-30-suite-gpt_nano-nvlink-2x-NVIDIA-H200.md").read_text())
    labels = {arm.label for arm in ARMS}
    assert rows[0][0] == "plain torch, 1 GPU" and len(rows) > 1
    assert all(name in labels and samples_per_s > 0 for name, samples_per_s in rows)
