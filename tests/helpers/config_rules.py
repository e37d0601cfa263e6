"""The config rules asked on typed configs and synthetic host facts: a config of the schema's defaults
plus overrides, a host, and the problems the rules find (test_validation.py and the rooms' own tests)."""

from __future__ import annotations

import dataclasses

from flodl.config.host import GIB, HostFacts
from flodl.config.rules import ConfigError, validate
from flodl.config.schema import FlodlConfig, to_config

TASK = {"name": "t", "model": "m", "train_data": "d", "loss": "l", "optimizer": "o"}
HOST = HostFacts(
    gpus=0,
    ranks_per_node=1,
    world_size=1,
    under_torchrun=False,
    stage_dir_free_bytes=100 * GIB,
    available_ram=64 * GIB,
)


def make(**overrides: object) -> FlodlConfig:
    """A typed config: the schema defaults plus `overrides` (dotted keys for nested groups)."""
    data: dict = {"task": dict(TASK)}
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return to_config(data)


def host(**changes: object) -> HostFacts:
    return dataclasses.replace(HOST, **changes)


def problems_of(cfg: FlodlConfig, facts: HostFacts = HOST) -> list[str]:
    try:
        validate(cfg, facts)
    except ConfigError as err:
        assert str(err).startswith("invalid flodl config:")
        for problem in err.problems:
            assert problem in str(err)
        return err.problems
    return []


def assert_problem(problems: list[str], key: str, value: object, rule: str) -> str:
    """One problem names `key=value` and states `rule`; returns it."""
    prefix = f"{key}={value!r}: "
    hits = [p for p in problems if p.startswith(prefix) and rule in p]
    assert hits, f"no problem {prefix!r}...{rule!r} in {problems}"
    return hits[0]
