"""Seeds a seed sweep draws anew on every test run, so that the moments a timing-dependent test checks (a
kill, a stop) change from run to run instead of being the same few forever: tests/conftest.py draws the
run's base once, in the process that starts pytest's workers (each worker collects the same seeds), and
names it at the run's end. `FLODL_TEST_SEED=<base>` draws that run's seeds again; `FLODL_CHAOS_TRIALS=N`
runs N seeds of each sweep (a long local run)."""

from __future__ import annotations

import os
import random

BASE = "FLODL_TEST_SEED"
TRIALS = "FLODL_CHAOS_TRIALS"


def draw_base() -> str:
    """This run's base: the one given, else a fresh one, in the environment for every worker to read."""
    os.environ.setdefault(BASE, str(random.SystemRandom().randrange(10**6)))
    return os.environ[BASE]


def drawn_seeds(sweep: str, count: int) -> list[int]:
    """`count` seeds in a row (so alternate parities, where a test takes its case from one) of `sweep`,
    from a start drawn from this run's base; FLODL_CHAOS_TRIALS seeds instead where it is set."""
    count = int(os.environ.get(TRIALS, count))
    first = random.Random(f"{sweep}-{draw_base()}").randrange(10**6)
    return list(range(first, first + count))
