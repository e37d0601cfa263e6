"""Under a compile mode that captures CUDA graphs, state is written into the captured tensors, never
rebound: the check itself, and a run whose averager (a test double) rebinds the parameters stopped at the
first round, naming them. The captures themselves, and reduce-overhead against eager, run on a GPU
(tests/runs/test_gpu.py); the in-place rounds under it on CPU are in tests/test_step_options.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.procs import REPO, train


@pytest.mark.multiproc
def test_a_round_that_rebinds_the_parameters_stops_the_run_naming_them(tmp_path: Path) -> None:
    double = str(REPO / "tests" / "helpers" / "rebinding_round")
    result = train(
        "policy=cadence",
        "epochs=1",
        "compile=true",
        "compile_mode=reduce-overhead",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=240,
        PYTHONPATH=os.pathsep.join([double, str(REPO)]),
    )
    assert result.code != 0 and not result.timed_out, result.out[-3000:]
    assert "StorageMoved: after round 1, net.0.bias, net.0.weight, net.2.bias and 3 more" in result.out
    assert not (tmp_path / "run" / "model.pt").exists()
