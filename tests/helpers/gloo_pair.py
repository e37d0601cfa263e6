"""Two members of one real gloo group in one process, each in a thread of its own: the votes of a sharded
group's members (tests/unit/test_group_evals.py, tests/unit/test_group_steps.py; the same group's members in
2 processes of a run: tests/runs/test_sharded_survive.py, test_sharded_survive_async.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import HashStore


def gloo_pair(timeout_s: float = 30.0) -> list[dist.ProcessGroup]:
    """A gloo group of 2, each member formed in a thread of its own, together."""
    store, groups = HashStore(), [None, None]

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))

    together([lambda: form(0), lambda: form(1)])
    return groups  # type: ignore[return-value]


def together(calls: list[Callable[[], object]]) -> list[object]:
    """Each call in a thread of its own, at once: what each returned."""
    said: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        said[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a member never came back from its vote"
    return said
