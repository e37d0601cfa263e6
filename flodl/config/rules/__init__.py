"""Config validation, run before any rank is started.

Pure: host facts (GPU count, free disk) come in as a `HostFacts` value, so every rule is tested without the
hardware. All violations are reported together, each naming key, value and rule. One topic a room:
- `values`: each key alone (its allowed values, its range);
- `combinations`: what the keys allow of each other (the policy's knobs, the outer optimizer, the wire);
- `survive`: what fault_tolerance=survive cannot do (yet, or under this launcher);
- `sharding`: what shard_group asks of the job's ranks, and what sharded groups cannot do yet;
- `host_fit`: what this host can run (devices, launcher, precision, disk);
- `ignored`: keys set to a value the rest of the config would silently ignore, and keys not implemented.
"""

from __future__ import annotations

from flodl.config.host import HostFacts
from flodl.config.rules.combinations import LOCAL_SGD_KNOBS, combination_problems
from flodl.config.rules.host_fit import host_problems
from flodl.config.rules.ignored import NOT_IMPLEMENTED, ignored_problems, not_implemented
from flodl.config.rules.sharding import sharding_problems
from flodl.config.rules.survive import survive_problems
from flodl.config.rules.values import CHOICES, NULL_MEANS, START_METHODS, value_problems
from flodl.config.schema import FlodlConfig

__all__ = [
    "CHOICES",
    "LOCAL_SGD_KNOBS",
    "NOT_IMPLEMENTED",
    "NULL_MEANS",
    "START_METHODS",
    "ConfigError",
    "validate",
]


class ConfigError(ValueError):
    """One or more config values break a rule; the message lists each as `key=value: rule`."""

    def __init__(self, problems: list[str]) -> None:
        # One line per problem, whatever an error's text holds; one problem, one line; several, one block.
        self.problems = [" ".join(p.split()) for p in problems]
        block = "".join(f"\n  - {p}" for p in self.problems)
        lines = self.problems[0] if len(self.problems) == 1 else block
        super().__init__(f"invalid flodl config: {lines}")


def validate(cfg: FlodlConfig, host: HostFacts) -> None:
    """Raise ConfigError listing every broken rule; return quietly when the config is sound."""
    problems = [
        *value_problems(cfg),
        *combination_problems(cfg, host.world_size),
        *survive_problems(cfg, host),
        *sharding_problems(cfg, host),
        *host_problems(cfg, host),
        *ignored_problems(cfg, host),
        *not_implemented(cfg),
    ]
    if problems:
        raise ConfigError(problems)
