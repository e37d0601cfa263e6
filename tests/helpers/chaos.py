"""The fault harness (issue 54): one trial runs a 2-rank digits job, injects one fault at a moment drawn
from a seed, goes on as the fault asks (a stopped or failed job resumed by `resume=auto` or the command it
printed; a survive job left to heal), and checks the invariants from the run's own files and the ids every
rank logged for every step it trained (tests/helpers/sample_log). It returns the violations it found, each
named by its invariant: tests/runs/test_chaos.py runs a fixed set of seeds and asserts none, bench/chaos.py
runs many and publishes the counts. The job, its samples and the checks: tests/helpers/chaos_job.py.

Fault kinds:
- stop: SIGTERM or SIGINT to the launcher once rank 0 trained N steps; resumed by the command the stop
  printed, on 2 ranks or on 1 (a resize); sync, cadence or async, checkpoints by epoch or every 5 steps
  (sync: with keep_global_batch too).
- kill: SIGKILL of rank 0 or 1 under fault_tolerance=none; the failed job started again (resume=auto).
- survive-kill: SIGKILL of a rank under fault_tolerance=survive (cadence, async); its supervisor restarts it.
- freeze: SIGSTOP of a rank under survive past the heartbeat timeout, SIGCONT once it was cut.
- host-kill: SIGKILL of the launcher under survive (the run's host: its store, coordinator and records);
  its ranks must end on their own, and the job started again (resume=auto).
- disk-full: the checkpoints' file system (a tmpfs the trial mounts: root only) filled at a rank's step; the
  next checkpoint fails the job, which must name the last committed one; the space freed, resume=auto.
- disk-ro: the same file system remounted read-only instead; remounted read-write, resume=auto.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal
import subprocess
from pathlib import Path

from tests.helpers.chaos_job import (
    START_TIMEOUT_S,
    Job,
    Trial,
    check_each_sample_once,
    check_failure_line,
    check_ranks_end,
    check_run_end,
    check_stopped,
    parts_steps,
    read_samples,
    window_of_the_dead,
)
from tests.helpers.procs import kill_group, wait_for
from tests.helpers.stops import STOPPED
from tests.helpers.survive_runs import digests

KINDS = ("stop", "kill", "survive-kill", "freeze", "host-kill", "disk-full", "disk-ro")
# Digits on 2 ranks: 22 steps of 32 samples each an epoch per rank. A fault lands within the first half of
# the run, so the job surely has work left after it.
RANK_STEPS = 22


def stop_trial(job: Job, rng: random.Random, seed: int) -> Trial:
    policy = rng.choice(("sync", "cadence", "async"))
    sig = rng.choice((signal.SIGTERM, signal.SIGINT))
    schedules = [["checkpoint_every=1"], ["checkpoint_every_steps=5"]]
    if policy == "sync":  # a global step's samples kept across the resize (sync's own)
        schedules.append(["checkpoint_every_steps=5", "keep_global_batch=true"])
    schedule = rng.choice(schedules)
    at, world = rng.randint(1, 2 * RANK_STEPS), rng.choice((2, 1))
    trial = Trial(
        "stop", seed, f"{policy}: {sig.name} at rank 0's step {at}, {' '.join(schedule)}, resumed on {world}"
    )
    job.configure(f"policy={policy}", *schedule)
    proc = job.start()
    job.at_step(proc, 0, at)
    os.kill(proc.pid, sig)
    result = job.finish(proc, trial)
    if result.code == 0:  # the stop came after the run's last step: nothing to resume
        check_run_end(trial, job, result)
        check_each_sample_once(trial, job, read_samples(job.log_dir), set())
        return trial
    line = STOPPED.match(result.err.strip().splitlines()[-1]) if result.err.strip() else None
    if result.code != 128 + sig or line is None:
        trial.violated("stop-line", f"exit {result.code}, last line {result.err.strip()[-500:]!r}")
        return trial
    check_stopped(trial, job, Path(line.group(2)))
    resume = [a for a in shlex.split(line.group(4)) if not a.startswith("launch.nproc_per_node=")]
    proc = job.start([*resume, f"launch.nproc_per_node={world}"])
    result = job.finish(proc, trial)
    check_run_end(trial, job, result)
    if result.ok:
        check_each_sample_once(trial, job, read_samples(job.log_dir), set())
    return trial


def kill_trial(job: Job, rng: random.Random, seed: int, kind: str) -> Trial:
    """kill: a rank SIGKILLed under fault_tolerance=none; host-kill: the launcher, the run's host under
    survive (its store and records), SIGKILLed, its ranks left to notice; disk-full: the file system of the
    checkpoints (a tmpfs of its own) filled, so the next checkpoint fails. Then the job started again."""
    host, disk = kind == "host-kill", kind in ("disk-full", "disk-ro")
    policy = rng.choice(("cadence", "async") if host else ("sync", "cadence", "async"))
    victim, at = rng.randint(0, 1), rng.randint(1, 2 * RANK_STEPS)
    schedule = rng.choice((["checkpoint_every=1"], ["checkpoint_every_steps=5"]))
    fault = {
        "host-kill": "the host SIGKILLed",
        "disk-full": "the checkpoints' disk filled",
        "disk-ro": "the checkpoints' disk made read-only",
    }.get(kind, f"rank {victim} SIGKILLed")
    trial = Trial(kind, seed, f"{policy}: {fault} at rank {victim}'s step {at}, {schedule[0]}")
    extra = ["fault_tolerance=survive"] if host else [f"save_path={job.small_disk()}"] if disk else []
    job.configure(f"policy={policy}", *schedule, *extra)
    proc = job.start()
    pid = job.at_step(proc, victim, at)
    if kind == "disk-full":
        filler = fill(job.checkpoints.parent)
    elif disk:
        remount(job.checkpoints.parent, "ro")
    else:
        os.kill(proc.pid if host else pid, signal.SIGKILL)
    result = job.finish(proc, trial)
    if result.ok:
        trial.violated("job-ended", f"the job ended well with {fault}")
        return trial
    if host:
        check_ranks_end(trial, job)
        latest = job.checkpoints / "latest"
        named = latest.parent / latest.read_text() if latest.is_file() else None
    else:
        named = check_failure_line(trial, job, result)
    held = parts_steps(named) if named else {}
    if kind == "disk-full":
        filler.unlink()  # the space back, as an operator would make it
    elif disk:
        remount(job.checkpoints.parent, "rw")
    result = job.finish(job.start(), trial)  # resume=auto
    check_run_end(trial, job, result)
    if result.ok:
        samples = read_samples(job.log_dir)
        retrained = {s for s in samples if s.start == 0 and s.step > held.get(s.rank, 0)}
        check_each_sample_once(trial, job, samples, retrained)
    return trial


def remount(disk: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True)


def fill(disk: Path) -> Path:
    """Fill the file system at `disk` with one file; that file."""
    filler = disk / "filler"
    with filler.open("wb") as file, contextlib.suppress(OSError):  # ENOSPC: full
        while True:
            file.write(bytes(1 << 16))
            file.flush()
    return filler


def survive_trial(job: Job, rng: random.Random, seed: int, kind: str) -> Trial:
    policy, victim, at = rng.choice(("cadence", "async")), rng.randint(0, 1), rng.randint(1, 2 * RANK_STEPS)
    how = "SIGKILLed" if kind == "survive-kill" else "SIGSTOPped (SIGCONT once cut)"
    trial = Trial(kind, seed, f"{policy}, survive: rank {victim} {how} at its step {at}")
    # A frozen rank is cut once the heartbeat timeout passed: short here. A killed one is cut at once.
    heartbeat = ["heartbeat_timeout_s=2"] if kind == "freeze" else []
    job.configure(f"policy={policy}", "fault_tolerance=survive", *heartbeat)
    proc = job.start()
    pid = job.at_step(proc, victim, at)
    if kind == "survive-kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        timeline = job.run_dir / "timeline.jsonl"
        wait_for(lambda: '"rank_cut"' in timeline.read_text(), proc, START_TIMEOUT_S, f"rank {victim} cut")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    result = job.finish(proc, trial)
    check_run_end(trial, job, result)
    if not result.ok:
        return trial
    final = digests(result.out + result.err, "final round")  # a restart not admitted by the end says none
    if 1 - victim not in final or len(set(final.values())) != 1:
        trial.violated("ranks-equal", f"final states {final}")
    samples = read_samples(job.log_dir)
    window = window_of_the_dead(trial, job, samples, victim, pid)
    check_each_sample_once(trial, job, samples, window, may_lose=True)
    return trial


def run_trial(work: Path, kind: str, seed: int) -> Trial:
    """One trial of `kind` in `work` (a fresh dir), its moments drawn from `seed`; a harness failure (an event
    that never came, a file the checks need missing) is reported as the violation `harness`. No process of it
    outlives it."""
    job, rng = Job(work), random.Random(f"{kind}-{seed}")
    try:
        if kind == "stop":
            return stop_trial(job, rng, seed)
        if kind in ("kill", "host-kill", "disk-full", "disk-ro"):
            return kill_trial(job, rng, seed, kind)
        assert kind in ("survive-kill", "freeze"), f"no fault kind {kind!r}"
        return survive_trial(job, rng, seed, kind)
    except Exception as error:  # a bench of many trials reports it and goes on
        trial = Trial(kind, seed)
        trial.violated(
            "harness", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
        return trial
    finally:
        for proc in job.procs:
            kill_group(proc)
        for disk in job.mounts:
            subprocess.run(["umount", "--lazy", str(disk)], check=False)
