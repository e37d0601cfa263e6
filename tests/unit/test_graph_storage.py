"""Under a compile mode that captures CUDA graphs, state is written into the captured tensors, never
rebound: the check itself, and a run whose averager (a test double) rebinds the parameters stopped at the
first round, naming them. The captures themselves, and reduce-overhead against eager, run on a GPU
(tests/runs/test_gpu.py); the in-place rounds under it on CPU are in tests/test_step_options.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl.worker.graph_storage import CapturedStorage, StorageMoved


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_writes_in_place_pass_and_a_rebound_parameter_or_buffer_is_named():
    model = _model()
    storage = CapturedStorage(model, "reduce-overhead")
    with torch.no_grad():
        model[0].weight.copy_(torch.ones(4, 4))
        model[1].running_mean.add_(1.0)
    storage.check("an in-place round")
    model[0].weight.data = torch.zeros(4, 4)
    with pytest.raises(StorageMoved, match=r"after round 3, 0\.weight no longer live"):
        storage.check("round 3")

    model = _model()
    storage = CapturedStorage(model, "max-autotune")
    model[1]._buffers["running_var"] = torch.ones(4)
    with pytest.raises(StorageMoved, match=r"1\.running_var"):
        storage.check("an admission")


def test_modes_that_capture_no_graph_check_nothing():
    for mode in (None, "default", "max-autotune-no-cudagraphs"):
        model = _model()
        storage = CapturedStorage(model, mode)
        model[0].weight.data = torch.zeros(4, 4)
        storage.check("a round")
