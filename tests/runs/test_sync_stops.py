"""A sync stop loses no step trained, whatever moment it lands at (timing is an input): 2 gloo ranks on
digits, stopped by SIGTERM at steps drawn from a seed, each stop resumed by the command it printed and stopped
again, the last resume running to the end. The ranks agree on a step about two seconds of steps ahead and
train to it; every checkpoint they write on the way is committed, the agreed step's last. After each stop: no
`.partial` dir, `latest` is the checkpoint the stop names, and each rank's part in it holds the last step the
rank trained (its "stops after global step" line). The finished run has every epoch once, each epoch's every
sample trained once. FLODL_CHAOS_TRIALS sets the stops per schedule (2 here; more for a long local run)."""

from __future__ import annotations

import os
import random
import shlex
from pathlib import Path

import pytest

from tests.helpers.procs import FAST_START, PYTHON, TRAIN, run
from tests.helpers.runs import assert_complete_run
from tests.helpers.stops import (
    check_stop_kept_every_step,
    hooks_env,
    sigterm_once_held,
    stopped_by_sigterm,
    stops_after,
)

pytestmark = pytest.mark.multiproc

TRIALS = int(os.environ.get("FLODL_CHAOS_TRIALS", "2"))
# Digits under sync on 2 ranks: 22 steps of 2 x 32 samples an epoch.
STEPS, SAMPLES = 22, 1408
# Each step waits this long first (tests/helpers/held_steps): at most 50 steps a second, so the stop's agreed
# step is at most about 100 steps past the signal, however fast the machine.
STEP_S = 0.02
# A stop's hold lands 1 to 44 steps past the last one's checkpoint; each stop trains at most ~146 steps.
EPOCHS = 2 + TRIALS * 146 // STEPS


@pytest.mark.parametrize(
    ("seed", "schedule"),
    [(54, ["checkpoint_every=1"]), (55, ["checkpoint_every_steps=5", "keep_global_batch=true"])],
    ids=["every-epoch", "every-5-steps-keep-global-batch"],
)
def test_a_sync_stop_commits_the_step_it_stops_at_whenever_it_lands(
    tmp_path: Path, seed: int, schedule: list[str]
) -> None:
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    args = [
        PYTHON,
        TRAIN,
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=sync",
        f"epochs={EPOCHS}",
        *schedule,
        f"hydra.run.dir={run_dir}",
    ]
    committed = 0  # the global step of the last stop's checkpoint
    for stop in range(TRIALS):
        held = tmp_path / f"stop{stop}"
        held.mkdir()
        env = hooks_env(held, committed + rng.randint(1, 2 * STEPS), FLODL_TEST_STEP_S=str(STEP_S))
        result = sigterm_once_held(args, held, env, stop_log=run_dir / "rank0.log")
        stopped_at, resume = stopped_by_sigterm(result)
        check_stop_kept_every_step(run_dir, stopped_at, stop + 1)
        committed = stops_after(run_dir / "rank0.log")[-1]
        args = shlex.split(resume)
    run(args, cwd=tmp_path, timeout=240).check()
    records = assert_complete_run(run_dir, world=2, epochs=EPOCHS)  # every epoch once, in order
    assert [(r["step"], r["samples"]) for r in records] == [((e + 1) * STEPS, SAMPLES) for e in range(EPOCHS)]
