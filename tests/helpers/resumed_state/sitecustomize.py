"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH (before
tests/helpers/sample_log, whose hook it loads too): with $FLODL_TEST_RESUMED_STATE set (a dir), each rank that
reads a sharded checkpoint's state writes what it holds once it has read it to `rank<R>.pt` there: its group
(None: sync's one state), each trainable parameter's local rows (a shard's, or the whole tensor of a full
replica) and the outer optimizer's momentum laid out the same (tests/runs/test_sharded_survive_resumes.py
puts a group's shards together and compares them with the checkpoint's)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "sample_log" / "sitecustomize.py"))

_DIR = os.environ.get("FLODL_TEST_RESUMED_STATE")

if _DIR:
    import torch
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    from flodl.worker.sharded_state import ShardedState

    _load = ShardedState.load

    def _local(tensor: Tensor) -> Tensor:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()

    def _dumped_load(self: ShardedState, path: Path) -> None:
        _load(self, path)
        named = {name: _local(p) for name, p in self.model.named_parameters() if p.requires_grad}
        momentum = {name: _local(t) for name, t in self._momentum().items()}
        state = {"group": self.group, "model": named, "momentum": momentum}
        Path(_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(state, Path(_DIR) / f"rank{self.rank}.pt")

    ShardedState.load = _dumped_load  # type: ignore[method-assign]
