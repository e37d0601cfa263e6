"""precision=fp8 on a GPU that has float8 matmuls (skipped elsewhere): under sync on one GPU (eager, and
compiled with CUDA graphs) and under cadence with two ranks sharing it over gloo, a small GPT trains to the
loss bf16 reaches at the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.float8 import GPU_FLOAT8, SMALL_GPT
from tests.helpers.procs import train

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, GPU_FLOAT8]
# Per-tensor scaled e4m3 against bf16 after two short epochs: the same curve within this much. Under
# cadence ElChe's windows follow the ranks' timing, so two runs differ by more than their precision does
# (measured on one H200: 3.0% apart, fp8 the lower). Compiled with CUDA graphs, one H100 measured 0.27%
# apart, and 1.2% while the compiled backward pass read a maximum too soon (flodl/worker/float8.py).
LOSS_TOLERANCE = {"sync-1-gpu": 0.03, "sync-1-gpu-cuda-graphs": 0.01, "cadence-2-ranks-on-1-gpu": 0.06}


def _last_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    return float(records[-1]["eval/loss"])


@pytest.mark.parametrize(
    "how",
    [
        ("policy=sync", "compile=false"),
        ("policy=sync", "compile=true", "compile_mode=reduce-overhead"),
        ("policy=cadence", "launch.nproc_per_node=2", "backend=cpu", "compile=false"),
    ],
    ids=["sync-1-gpu", "sync-1-gpu-cuda-graphs", "cadence-2-ranks-on-1-gpu"],
)
def test_fp8_trains_to_the_loss_bf16_reaches(
    tmp_path: Path, how: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    losses = {}
    for precision in ("bf16", "fp8"):
        run_dir = tmp_path / precision
        train(
            *SMALL_GPT, *how, f"precision={precision}", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600
        ).check()
        losses[precision] = _last_loss(run_dir)
    assert abs(losses["fp8"] / losses["bf16"] - 1) < LOSS_TOLERANCE[request.node.callspec.id], losses
