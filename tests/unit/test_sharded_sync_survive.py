"""Sync by sharded groups under fault_tolerance=survive: what the rules take and what they refuse, naming the
key (tests/runs/test_sharded_survive_sync.py runs it)."""

from __future__ import annotations

import pytest

from tests.helpers.config_rules import assert_problem, host, make, problems_of

FOUR = host(world_size=4, ranks_per_node=4)
SYNC_BY_GROUPS = {
    "shard_group": 2,
    "policy": "sync",
    "checkpoint_every": None,
    "fault_tolerance": "survive",
    "launch.nproc_per_node": 4,
}


def test_sync_by_groups_survives_with_restarts_evals_clipping_and_checkpoints() -> None:
    cfg = make(**SYNC_BY_GROUPS, **{"launch.max_restarts": 2}, eval_every=1, max_grad_norm=1.0)
    assert problems_of(cfg, FOUR) == []
    # Each group in writes its own save (tests/runs/test_sharded_survive_sync.py).
    for checkpoints in ({"checkpoint_every": 1}, {"checkpoint_every_steps": 5}):
        assert problems_of(make(**{**SYNC_BY_GROUPS, **checkpoints}), FOUR) == [], checkpoints


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("keep_global_batch", True, "the groups left step their own micro-batches"),
        ("precision", "fp16", "its GradScaler skips a step without the vote"),
        ("launch.max_ranks", 6, "a job does not grow by groups yet"),
    ],
)
def test_what_sync_by_groups_does_not_do_yet_is_refused_naming_the_key(
    key: str, value: object, why: str
) -> None:
    said = assert_problem(
        problems_of(make(**{**SYNC_BY_GROUPS, key: value}), FOUR),
        key,
        value,
        "not with fault_tolerance=survive and shard_group=2 yet (under policy=sync",
    )
    assert why in said
    # Under cadence a job grows by groups.
    if key == "launch.max_ranks":
        cadence = make(**{**SYNC_BY_GROUPS, "policy": "cadence", key: value})
        assert problems_of(cadence, FOUR) == []
