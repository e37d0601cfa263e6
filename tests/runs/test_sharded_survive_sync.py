"""Sync by sharded groups under fault_tolerance=survive (docs/sharded-groups.md#survive-by-groups): 4 gloo
ranks as 2 groups of 2, FSDP2 inside each group (its process's world) and each step's gradient shards averaged
across the groups over the members of each shard index, torchft's FT-HSDP. Without a death it ends where
HSDP does: one process on the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import FAST_START
from tests.helpers.sync_reference import assert_matches_reference

pytestmark = pytest.mark.multiproc

SURVIVE_BY_GROUPS = (
    "device=cpu",
    FAST_START,
    "shard_group=2",
    "checkpoint_every=null",
    "fault_tolerance=survive",
)


def test_without_a_death_it_ends_where_hsdp_does(tmp_path: Path) -> None:
    # HSDP (tests/runs/test_sharded_sync.py) ends where one process on the global batch does, within 1e-5:
    # so does this run, evaluated after its epoch as every group's members evaluate their shares together.
    (record,) = assert_matches_reference(tmp_path, 1e-5, *SURVIVE_BY_GROUPS, world=4, evals=True)
    assert record["world"] == 4
    for rank in range(4):
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        assert f"rank {rank}: shard {rank % 2} of group {rank // 2} (FSDP2 in the group, gradients" in log
