"""A real Adam that also writes, after every step, the parameters it just produced (a test hook).

The file is `rank{R}.pt` under $FLODL_TEST_RECORD_DIR, overwritten each step: at the end of a run it holds
what the rank's parameters were after its last step, which under local SGD is what it brought to the last
round.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class RecordingAdam(torch.optim.Adam):
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        params = [p.detach().cpu().clone() for group in self.param_groups for p in group["params"]]
        torch.save(params, Path(os.environ["FLODL_TEST_RECORD_DIR"]) / f"rank{dist.get_rank()}.pt")
        return loss
