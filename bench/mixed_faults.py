"""Goodput under mixed faults (issue 54, item 3): one survive job of `--ranks` ranks, a fault every
`--every-s` seconds for `--duration-s`, each a random kind of `--kinds` on a random rank (rank 0 included):

- kill: SIGKILL; it is started again and admitted back.
- freeze: SIGSTOP; the others cut it once `heartbeat_timeout_s` passed without a word from it, and its
  supervisor ends it and starts it again (a SIGCONT follows, for a process still there).
- partition: the rank's network link down (its process runs on, its traffic is dropped), up again once the
  others cut it; its supervisor (or the process itself) reads the cut and ends it, and it is started again.

The ranks are self-launched (their supervisor starts them again), or with `--apart` (implied by partition,
root only) started apart as on several hosts: the run's host (flodl-coordinator) here, each rank's command in
a network namespace of its own on one bridge (bench/ranks_apart.py), which starts its rank again itself
(launch.max_restarts: flodl/launcher/apart.py).

The same job undisturbed before it and after it (as long, or `--calm-s`), in the same invocation; or, with
`--side-by-side`, at the same time, each job (its ranks, restarts and host) on its own half of the CPUs, so
both see the same machine for the same minutes (a run slows as it goes on: compare equal lengths). Reports
goodput (samples/s between the first and last fault against the undisturbed run's), whether the loss
still fell, every epoch recorded once and one final state on every rank, and per fault kind: detection
(fault -> cut), the survivors' first good round after it, and rejoin (fault -> admitted again), median / p95.

    python bench/mixed_faults.py --ranks 8 --duration-s 600 --every-s 29 --side-by-side \
        --kinds kill,freeze,partition                                                    # the issue's run
    python bench/mixed_faults.py --ranks 4 --duration-s 60 --every-s 10                  # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from benchlib import environment_lines, results_path, write_report
from ranks_apart import RanksApart
from survive import both, final_states, membership_events, rank_process, window_rate

from tests.helpers.procs import PYTHON, TRAIN, child_env, finish, kill_group, start


@dataclass
class Fault:
    kind: str
    rank: int
    at: float


class Launched:
    """The job self-launched: one command, its supervisor starting the ranks and starting them again."""

    def __init__(self, run: Path, work: Path, overrides: list[str]) -> None:
        self.args, self.work = [PYTHON, TRAIN, *overrides, f"hydra.run.dir={run}"], work

    def __enter__(self) -> Launched:
        self.proc = start(self.args, cwd=self.work, env=child_env())
        return self

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        return finish(self.proc, 300).out

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)


def undisturbed(job: Launched | RanksApart, run: Path, seconds: float) -> Path:
    """The job run for `seconds`, then stopped where it is; its run dir."""
    with job:
        deadline = time.time() + seconds
        while job.running() and time.time() < deadline:
            time.sleep(0.5)
        (job.work / f"{run.name}.out").write_text(job.stop())
    return run


def inject(job: Launched | RanksApart, run: Path, args: argparse.Namespace) -> list[Fault]:
    """Run the faulted job; the faults, in order."""
    chooser = random.Random(args.seed)
    kinds = args.kinds.split(",")
    faults: list[Fault] = []
    undo: list[tuple[float, Callable[[], None]]] = []  # (when: a freeze's wake, a partition's end)
    with job:
        # The faults' clock starts once the job trains (its first epoch recorded): a fault among ranks still
        # importing measures a start-up, not a run.
        while job.running() and not (run / "metrics.jsonl").is_file():
            time.sleep(0.1)
        end = time.time() + args.duration_s
        next_fault = time.time() + args.every_s
        while job.running() and time.time() < end:
            time.sleep(0.1)
            for due in [u for u in undo if u[0] <= time.time()]:
                undo.remove(due)
                due[1]()
            if time.time() < next_fault:
                continue
            kind, rank = chooser.choice(kinds), chooser.randrange(args.ranks)
            target = rank_process(run, rank)
            if target is None:  # not a member now (restarting): the next moment
                continue
            # Ended once the others cut it (heartbeat_timeout_s), and a little after.
            ends = time.time() + args.heartbeat_s + 2.0
            if kind == "partition":
                assert isinstance(job, RanksApart)
                job.cut_off(rank)
                undo.append((ends, functools.partial(job.reconnect, rank)))
            else:
                target.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                if kind == "freeze":
                    undo.append((ends, functools.partial(wake, target)))
            faults.append(Fault(kind, rank, time.time()))
            next_fault = time.time() + args.every_s
        for _, then in undo:
            then()
        time.sleep(args.every_s)  # the last fault's rank back in, then the run stopped where it is
        (job.work / f"{run.name}.out").write_text(job.stop())
    return faults


def wake(process: psutil.Process) -> None:
    """SIGCONT, unless its supervisor ended it already (it is ended once cut, to be started again)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(signal.SIGCONT)


def per_kind(run: Path, faults: list[Fault], undisturbed: float) -> list[str]:
    """Per fault kind: detection, the survivors' first good round, rejoin (median / p95 over its faults), and
    the job's rate while the fault was being detected, as a share of the undisturbed rate."""
    events = membership_events(run)
    rows = [
        "| fault | count | fault -> cut | cut -> first good round | fault -> admitted again | rate while "
        "detecting |",
        "|---|---|---|---|---|---|",
    ]
    for kind in sorted({f.kind for f in faults}):
        detect, first, rejoin, detecting = [], [], [], []
        for fault in (f for f in faults if f.kind == kind):
            mine = [e for e in events if e["rank"] == fault.rank and e["at"] >= fault.at]
            cut = next((e for e in mine if e["event"] == "rank_cut"), None)
            back = next((e for e in mine if e["event"] == "rank_admitted"), None)
            if cut is not None:
                detect.append(cut["at"] - fault.at)
                detecting.append(window_rate(run, fault.at - 0.5, cut["at"] + 0.5) / undisturbed)
                if cut["first_round_s"] is not None:
                    first.append(cut["first_round_s"])
            if back is not None:
                rejoin.append(back["at"] - fault.at)
        count = sum(f.kind == kind for f in faults)
        rows.append(
            f"| {kind} | {count} | {both(detect)} | {both(first)} | {both(rejoin)} | {both(detecting)} |"
        )
    return rows


def loss_fell(run: Path, since: float, until: float) -> str:
    """The train loss of the first and last tenth of the epochs inside the faulted window."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    inside = [r["loss"] for r in records if since <= r["window_start"] and r["window_end"] <= until]
    tenth = max(1, len(inside) // 10)
    head, tail = statistics.mean(inside[:tenth]), statistics.mean(inside[-tenth:])
    return f"{head:.4f} -> {tail:.4f} ({'falling' if tail < head else '**not falling**'})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--every-s", type=float, default=29.0)
    parser.add_argument(
        "--calm-s", type=float, default=None, help="each undisturbed run's length (default: --duration-s)"
    )
    parser.add_argument("--kinds", default="kill,freeze", help="of kill, freeze, partition")
    parser.add_argument(
        "--apart",
        action="store_true",
        help="ranks started apart, each in a network namespace (root; implied by partition)",
    )
    parser.add_argument("--heartbeat-s", type=float, default=3.0, help="heartbeat_timeout_s")
    parser.add_argument("--policy", default="async", choices=["cadence", "async"])
    parser.add_argument(
        "--side-by-side", action="store_true", help="the undisturbed job at the same time, on half the CPUs"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-mixed"))
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time())
    common = [
        "device=cpu",
        "fault_tolerance=survive",
        f"heartbeat_timeout_s={args.heartbeat_s}",
        f"policy={args.policy}",
        "eval_every=0",
        "epochs=100000",
        # Checkpoints by time, as a long run of short epochs takes them: a checkpoint every epoch would end
        # a segment every tenth of a second on digits, and a segment's last window has nothing left to hand
        # the members that a silent one holds up (rounds/supply.py).
        "checkpoint_every=null",
        "checkpoint_every_s=30",
        *args.overrides,
    ]
    apart = args.apart or "partition" in args.kinds.split(",")

    # Every fault on one rank, at worst. The undisturbed job is started the same way (a rank apart with
    # restarts is its command's child, a spare beside it), so that only the faults differ.
    restarts = f"launch.max_restarts={int(args.duration_s // args.every_s) + 1}"

    def job(run: Path) -> Launched | RanksApart:
        if apart:
            return RanksApart(run, args.work, [*common, restarts], args.ranks)
        launch = [f"launch.nproc_per_node={args.ranks}", "launch.start_method=fork"]
        return Launched(run, args.work, [*common, *launch, restarts])

    def calm(when: str) -> Path:
        run = args.work / f"calm-{when}-{stamp}"
        return undisturbed(job(run), run, args.calm_s or args.duration_s)

    faulted = args.work / f"faulted-{stamp}"
    if args.side_by_side:
        calms = side_by_side(lambda: calm("beside"), lambda: inject(job(faulted), faulted, args))
        faults = calms.pop()
    else:
        before = calm("before")
        faults = inject(job(faulted), faulted, args)
        calms = [before, calm("after")]
    if not faults:
        out = (args.work / f"{faulted.name}.out").read_text()
        raise SystemExit(f"no fault was injected: the faulted job's output ends\n{out[-3000:]}")
    lines = report(args, common, faulted, faults, calms)
    write_report(results_path(args.results_dir, "mixed-faults", cpu=True), "\n".join(lines))


def side_by_side(calm, faulted) -> list:
    """Both jobs at once, each started from a thread pinned to its half of this process's CPUs (a process
    inherits the affinity of the thread that starts it, and so do its ranks and restarts): [calm, faulted]."""
    cpus = sorted(os.sched_getaffinity(0))
    halves = cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]
    out: list = [None, None]

    def pinned(i: int, job) -> None:
        os.sched_setaffinity(0, halves[i])  # this thread only
        out[i] = job()

    threads = [threading.Thread(target=pinned, args=(i, job)) for i, job in enumerate((calm, faulted))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def report(
    args: argparse.Namespace, common: list[str], run: Path, faults: list[Fault], calms: list[Path]
) -> list[str]:
    first, last = faults[0].at, faults[-1].at
    churned = window_rate(run, first, last)
    # Beside it: the undisturbed job over the same minutes.
    rates = [window_rate(c, first, last) if args.side_by_side else window_rate(c) for c in calms]
    where = "beside it" if args.side_by_side else "before and after it"
    undisturbed = statistics.mean(rates)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    once = [r["epoch"] for r in records] == list(range(len(records)))
    logs = "".join(log.read_text() for log in sorted(run.glob("rank*.log")))
    states = final_states(logs, args.policy)
    counts = ", ".join(f"{k} {sum(f.kind == k for f in faults)}" for k in sorted({f.kind for f in faults}))
    return [
        "",
        f"## survive ({args.policy}), {args.ranks} ranks: a fault every {args.every_s:g} s for "
        f"{args.duration_s:g} s ({args.kinds})",
        *environment_lines(cpu=True),
        f"- overrides: `{' '.join(common)}`",
        f"- faults: {len(faults)} ({counts})",
        "",
        *per_kind(run, faults, undisturbed),
        "",
        f"- goodput: {churned:,.0f} samples/s between the first and last fault against {undisturbed:,.0f} "
        f"undisturbed ({' and '.join(f'{r:,.0f}' for r in rates)}"
        f", {where}): **{churned / undisturbed:.3f}**",
        f"- train loss in the faulted window (first tenth -> last): {loss_fell(run, first, last)}",
        f"- every epoch recorded once: {'yes' if once else '**no**'}; one final state on every rank: "
        f"{'yes' if len(states) > 1 and len(set(states.values())) == 1 else '**no**'} ({len(states)} ranks)",
    ]


if __name__ == "__main__":
    main()
