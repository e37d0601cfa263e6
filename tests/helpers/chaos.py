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
- partition: the link of a rank's network namespace taken down under survive (ranks started apart beside
  flodl-coordinator, as on several hosts), back up once it was cut; the rank's process must end changing
  nothing, and is started again in its namespace (root only).
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
from tests.helpers.procs import PYTHON, Child, finish, free_port, kill_group, wait_for
from tests.helpers.stops import STOPPED
from tests.helpers.survive_runs import digests

KINDS = ("stop", "kill", "survive-kill", "freeze", "host-kill", "disk-full", "disk-ro", "partition")
COORDINATOR = str(Path(PYTHON).parent / "flodl-coordinator")
# A rank cut while alive (its link down) ends once it reaches the store again and reads its cut, as it waits
# for work (job/rank.py), or when a group's word it waits for is 2 heartbeat timeouts + 10 s late: well
# within this.
CUT_ENDS_S = 60
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
    check_members_equal(trial, digests(result.out + result.err, "final round"), victim)
    samples = read_samples(job.log_dir)
    window = window_of_the_dead(trial, job, samples, victim, pid)
    check_each_sample_once(trial, job, samples, window, may_lose=True)
    return trial


def partition_trial(job: Job, rng: random.Random, seed: int) -> Trial:
    """A rank cut off the network: the run's host (flodl-coordinator) and the ranks started apart, as on
    several hosts, meeting at the host end of a veth pair whose other end is in the victim's network
    namespace (tests/helpers/netns); the link taken down at the victim's step, back up once the coordinator
    cut it. The victim's process, which never stopped, must end changing nothing; the trial, as its host's
    restart loop, starts it again in its namespace, and the run stops once it was admitted back."""
    policy, victim, at = rng.choice(("cadence", "async")), rng.randint(0, 1), rng.randint(1, 2 * RANK_STEPS)
    trial = Trial(
        "partition", seed, f"{policy}, survive: rank {victim}'s link down at its step {at}, up once cut"
    )
    link = job.link()
    heartbeat = ["fault_tolerance=survive", "heartbeat_timeout_s=2"]
    job.configure(f"policy={policy}", *heartbeat, apart=True, until_admitted=True)
    meet = {"WORLD_SIZE": "2", "MASTER_ADDR": link.host_addr, "MASTER_PORT": str(free_port())}
    host = job.start([COORDINATOR, *job.args[2:]], env={"GLOO_SOCKET_IFNAME": link.host_if, **meet})

    def rank(r: int) -> Child:
        own = {"RANK": str(r), "GLOO_SOCKET_IFNAME": link.ns_if if r == victim else link.host_if}
        return job.start(job.args, more=True, inside=link if r == victim else None, env={**meet, **own})

    ranks = {r: rank(r) for r in (0, 1)}
    pid = job.at_step(host, victim, at)
    link.down()
    timeline = job.run_dir / "timeline.jsonl"
    wait_for(lambda: '"rank_cut"' in timeline.read_text(), host, START_TIMEOUT_S, f"rank {victim} cut")
    link.up()
    try:
        ranks[victim].wait(CUT_ENDS_S)
    except subprocess.TimeoutExpired:  # SIGKILLed: a stop signal to a rank is the run's stop
        trial.violated(
            "cut-rank-ends", f"rank {victim}'s process, cut, ran on {CUT_ENDS_S} s after its link was back"
        )
        os.killpg(ranks[victim].pid, signal.SIGKILL)
    if ranks[victim].returncode == 0:
        trial.violated(
            "cut-rank-ends", f"rank {victim}'s process, cut, exited 0: a restart loop takes it as done"
        )
    ranks[victim] = rank(victim)
    result = job.finish(host, trial)
    check_run_end(trial, job, result)
    codes = {r: finish(proc, START_TIMEOUT_S).code for r, proc in ranks.items()}
    if any(codes.values()):
        trial.violated("ranks-end", f"the ranks' processes exited {codes}")
    if not result.ok:
        return trial
    logs = "".join((job.run_dir / f"rank{r}.log").read_text() for r in (0, 1))
    final = digests(logs, "final round")
    check_members_equal(trial, final, victim)
    if victim not in final:
        trial.violated("ranks-equal", f"rank {victim}, started again, has no final state: {final}")
    samples = read_samples(job.log_dir)
    window = window_of_the_dead(trial, job, samples, victim, pid)
    check_each_sample_once(trial, job, samples, window, may_lose=True)
    return trial


def check_members_equal(trial: Trial, final: dict[int, str], victim: int) -> None:
    """The members' states after the final round (a restart not admitted by the end says none) are one."""
    if 1 - victim not in final or len(set(final.values())) != 1:
        trial.violated("ranks-equal", f"final states {final}")


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
        if kind == "partition":
            return partition_trial(job, rng, seed)
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
        for link in job.links:
            link.remove()
