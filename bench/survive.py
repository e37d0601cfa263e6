"""fault_tolerance=survive under real kills: how long the survivors take to go on, and what they keep.

Default: two runs of one self-launched 2-rank job (`--policy`, cadence by default), rank 1 SIGKILLed from
outside:
1. kills: rank 1's current process is killed every `--every-s` seconds, `--kills` times, each time
   restarted by the supervisor and admitted back. Per event, from the run's timeline: detection (kill ->
   cut: the supervisor posts the exit, the coordinator cuts), release of the survivors' collective, forming
   the new group, the first good round after the cut; per admission: the restart's start-up, its wait for a
   round boundary, forming and the first round with it.
2. throughput: rank 1 killed once, not restarted, after `--before` epochs: epoch samples/s with one rank
   left against (survivors / world) x samples/s of the epochs before.

`--churn`: `--ranks` ranks (3), a random one (rank 0 included) killed every `--every-s` seconds (20) for
`--duration-s` seconds, each restarted and admitted back; in the same invocation, the same job undisturbed
as long before it and after it. Reports each step's median and p95 over the events, and goodput: the
samples/s the churned run trained over its window against the undisturbed runs' mean.

`--rank0`: under each policy, rank 0 killed `--kills` times (3) in one run of `--epochs` epochs (40), spread
over the run by its recorded epochs, against the same run undisturbed: the run finishes, every epoch recorded
once, one final state on every rank, and the final eval accuracy of both.

    python bench/survive.py                                  # task=resnet on the GPUs
    python bench/survive.py --cpu --kills 3 -- task=digits   # a smoke run on CPU
    python bench/survive.py --cpu --churn                    # goodput under churn, 3 gloo ranks
    python bench/survive.py --churn --arm launch.spare=true --arm launch.spare=false -- task=digits  # A/B
    python bench/survive.py --cpu --rank0                    # rank 0 dying, every policy
    python bench/survive.py --rank0 --epochs 20 -- task=digits backend=cpu  # 3 ranks sharing one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import time
from pathlib import Path

import psutil
from benchlib import REPO, environment_lines, results_path, write_report

from flodl.metrics.timeline import TIMELINE_JSONL, read_timeline
from tests.helpers.procs import PYTHON, TRAIN, child_env, finish, kill_group, start


def rank_process(run: Path, rank: int) -> psutil.Process | None:
    """The live process of `rank` once it is a member: the last start its log names (a restart appends to the
    same log), if it is the rank's first or has been admitted since (a kill while a restart still starts up
    cuts nothing: it is not a member yet)."""
    log = run / f"rank{rank}.log"
    text = log.read_text() if log.exists() else ""
    starts = list(re.finditer(rf"rank {rank}/\d+ \(pid (\d+)\)", text))
    if not starts or (len(starts) > 1 and ", admitting [" not in text[starts[-1].end() :]):
        return None
    try:
        process = psutil.Process(int(starts[-1].group(1)))
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def epochs_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def launch(
    work: Path,
    name: str,
    overrides: list[str],
    timeout: float,
    kills: int,
    every_s: float,
    kill_after_epochs: list[int] | None,
    victims: list[int] | None = None,
    run_out: bool = False,
) -> tuple[Path, list[float]]:
    """Run the job, killing a rank from outside (rank 1, or one of `victims` at random each time) every
    `every_s` seconds, or once its records reach each of `kill_after_epochs`; the run dir and the kills' wall
    times (the job's output is kept beside the run dir). `run_out`: the job ends on its own after the kills
    (else it is stopped a kill interval after the last one)."""
    run = work / name
    args = [PYTHON, TRAIN, *overrides, f"hydra.run.dir={run}"]
    proc = start(args, cwd=work, env=child_env())
    killed: list[float] = []
    deadline = time.time() + timeout
    chooser = random.Random(0)
    try:
        next_kill = time.time() + every_s
        while proc.poll() is None and time.time() < deadline and len(killed) < kills:
            time.sleep(0.2)
            due = (
                epochs_done(run) >= kill_after_epochs[len(killed)]
                if kill_after_epochs is not None
                else time.time() >= next_kill
            )
            rank = chooser.choice(victims) if victims else 1
            target = rank_process(run, rank) if due else None
            if target is not None:
                target.send_signal(signal.SIGKILL)
                killed.append(time.time())
                next_kill = time.time() + every_s
        if kill_after_epochs is None and not run_out:  # the last restart admitted, stop the run where it is
            time.sleep(every_s)
            proc.send_signal(signal.SIGTERM)
        result = finish(proc, max(deadline - time.time(), 30))
        (work / f"{name}.out").write_text(result.out)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return run, killed


def membership_events(run: Path) -> list[dict]:
    """The run's membership changes, from its timeline."""
    if not (run / TIMELINE_JSONL).is_file():
        raise SystemExit(f"the run left no {TIMELINE_JSONL}: its output is {run}.out")
    return read_timeline(run)["membership"]


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def p95(values: list[float]) -> str:
    """The 95th percentile (nearest rank)."""
    return f"{sorted(values)[math.ceil(0.95 * len(values)) - 1]:.2f}" if values else "-"


def both(values: list[float]) -> str:
    return f"{median(values)} / {p95(values)}"


def window_rate(run: Path, since: float = 0.0, until: float = float("inf")) -> float:
    """Samples/s over the epochs whose work lies within [since, until] (unix seconds; all by default)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    inside = [r for r in records if r["window_start"] >= since and r["window_end"] <= until]
    if not inside:
        return 0.0
    span = max(r["window_end"] for r in inside) - min(r["window_start"] for r in inside)
    return sum(r["samples"] for r in inside) / span


def timeline_wall(run: Path) -> float:
    """The wall time the run's timeline counts from (its last start)."""
    events = [json.loads(line) for line in (run / TIMELINE_JSONL).read_text().splitlines() if line.strip()]
    return [event for event in events if event["kind"] == "start"][-1]["wall"]


def batch_rate(spans: list[dict], since: float, until: float) -> float:
    """Batches/s the ranks' spans trained inside [since, until] (timeline seconds), each span's batches
    spread evenly over it."""
    batches = 0.0
    for span in spans:
        overlap = min(span["end"], until) - max(span["start"], since)
        if overlap > 0:
            batches += span["batches"] * overlap / max(span["end"] - span["start"], 1e-9)
    return batches / (until - since)


def phase_lines(run: Path, killed: list[float], calms: list[Path], settle_s: float = 5.0) -> list[str]:
    """Where the churned run's time went: its batches/s while a rank was out (cut -> admitted), in the first
    `settle_s` after each admission, and otherwise (every rank in), each against the undisturbed runs'."""
    record, wall = read_timeline(run), timeline_wall(run)
    calm = statistics.mean(
        batch_rate(read_timeline(c)["spans"], 0.0, max(s["end"] for s in read_timeline(c)["spans"]))
        for c in calms
    )
    first, last = killed[0] - wall, killed[-1] - wall
    # Each moment between the first and last kill is in one phase: the membership changes mark them.
    marks = sorted(
        (e["at"] - wall, e["event"]) for e in record["membership"] if not e["why"].startswith("exiting")
    )
    out: list[tuple[float, float]] = []
    settling: list[tuple[float, float]] = []
    cut_at: float | None = None
    for at, event in marks:
        if event == "rank_cut" and cut_at is None:
            cut_at = at
        elif event == "rank_admitted" and cut_at is not None:
            out.append((cut_at, at))
            settling.append((at, at + settle_s))
            cut_at = None
    spans = record["spans"]

    def phase(intervals: list[tuple[float, float]]) -> tuple[float, float]:
        inside = [(max(a, first), min(b, last)) for a, b in intervals if min(b, last) > max(a, first)]
        seconds = sum(b - a for a, b in inside)
        rate = sum(batch_rate(spans, a, b) * (b - a) for a, b in inside) / seconds if seconds else 0.0
        return seconds, rate

    whole = last - first
    (out_s, out_rate), (settle_seconds, settle_rate) = phase(out), phase(settling)
    rest_s = whole - out_s - settle_seconds
    rest_rate = (
        batch_rate(spans, first, last) * whole - out_rate * out_s - settle_rate * settle_seconds
    ) / rest_s
    rows = [("a rank out (cut -> admitted)", out_s, out_rate)]
    rows += [(f"the first {settle_s:g} s after an admission", settle_seconds, settle_rate)]
    rows += [("every rank in, settled", rest_s, rest_rate)]
    lines = [
        "",
        "| phase (first to last kill) | share of the time | batches/s against undisturbed |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {seconds / whole:.2f} | {rate / calm:.2f} |" for name, seconds, rate in rows]
    return lines


def seconds(events: list[dict], key: str, scale: float = 1.0) -> list[float]:
    """The events' `key` (those that have one: a change the next one overtook has none), in seconds."""
    return [e[key] / scale for e in events if e.get(key) is not None]


def churn_report(run: Path, killed: list[float], calms: list[Path]) -> list[str]:
    events = membership_events(run)
    # The kills' cuts: not those of the ranks leaving when the bench stops the run (they say they exit).
    cuts = [e for e in events if e["event"] == "rank_cut" and not e["why"].startswith("exiting")]
    admits = [e for e in events if e["event"] == "rank_admitted" and e["formed_s"] is not None]
    # Each cut follows one kill: the kill closest before it.
    after_kill = [(c, c["at"] - max(k for k in killed if k <= c["at"])) for c in cuts if killed[0] <= c["at"]]
    detect = [d for _, d in after_kill]
    # kill -> first good round among the survivors: detection, then the cut's own first good round.
    to_round = [d + c["first_round_s"] for c, d in after_kill if c["first_round_s"] is not None]
    churned = window_rate(run, killed[0], killed[-1])
    before, after = (window_rate(calm) for calm in calms)
    undisturbed = (before + after) / 2
    why = "; ".join(sorted({c["why"] for c in cuts}))
    return [
        f"- kills: {len(killed)} (ranks chosen at random, rank 0 included), cuts: {len(cuts)}, admissions: "
        f"{len(admits)}; cut by: {why}",
        "",
        "| step (s) | median / p95 |",
        "|---|---|",
        f"| kill -> cut | {both(detect)} |",
        f"| collective released (max over members) | {both(seconds(cuts, 'release_ms', 1000))} |",
        f"| cut -> group re-formed | {both(seconds(cuts, 'formed_s'))} |",
        f"| cut -> first good round | {both(seconds(cuts, 'first_round_s'))} |",
        f"| kill -> first good round among the survivors | {both(to_round)} |",
        f"| restart's start-up | {both(seconds(admits, 'startup_s'))} |",
        f"| restart ready -> admitted (a round boundary) | {both(seconds(admits, 'waited_s'))} |",
        f"| admission -> first good round with it | {both(seconds(admits, 'first_round_s'))} |",
        "",
        f"- goodput: {churned:,.0f} samples/s under churn (between the first and the last kill) against "
        f"{undisturbed:,.0f} undisturbed ({before:,.0f} before it, {after:,.0f} after): "
        f"**{churned / undisturbed:.2f}**"
        + (
            ""
            if abs(before - after) <= 0.1 * undisturbed
            else " — the undisturbed runs differ by more than 10%: the machine's load changed; run it again"
        ),
        *phase_lines(run, killed, calms),
    ]


def final_states(out: str, policy: str) -> dict[str, str]:
    end = "the last epoch" if policy == "sync" else "final round"
    return dict(re.findall(rf"rank (\d+): state after {end}[^:]*: ([0-9a-f]+)", out))


def rank0_report(work: Path, name: str, run: Path, calm: Path, kills: list[float], policy: str) -> str:
    """The table row of one policy's run with rank 0 killed, against its undisturbed twin."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (calm / "metrics.jsonl").read_text().splitlines()]
    states = final_states((work / f"{name}.out").read_text(), policy)
    events = membership_events(run)
    rank0_cuts = sum(e["event"] == "rank_cut" and e["rank"] == 0 for e in events)
    once = "yes" if [r["epoch"] for r in records] == list(range(len(reference))) else "**no**"
    one_state = "yes" if len(states) > 1 and len(set(states.values())) == 1 else "**no**"
    accuracy = records[-1].get("eval/accuracy", float("nan"))
    expected = reference[-1].get("eval/accuracy", float("nan"))
    return (
        f"| {policy} | {len(kills)} | {rank0_cuts} | {once} | {one_state} ({len(states)} ranks) | "
        f"{accuracy:.4f} | {expected:.4f} | {100 * (accuracy - expected):+.2f} |"
    )


def kill_report(run: Path, killed: list[float]) -> list[str]:
    events = membership_events(run)
    cuts = [e for e in events if e["event"] == "rank_cut"]
    admits = [e for e in events if e["event"] == "rank_admitted"]
    # Each cut follows one kill: the kill closest before it.
    detect = [
        c["at"] - max(k for k in killed if k <= c["at"]) for c in cuts if any(k <= c["at"] for k in killed)
    ]
    lines = [
        f"- kills: {len(killed)}, cuts: {len(cuts)}, admissions: {len(admits)}",
        "",
        "| step (s, median) | cut (survivors go on) | admission (restart back in) |",
        "|---|---|---|",
        f"| kill -> detected | {median(detect)} | - |",
        f"| restart's start-up | - | {median([a['startup_s'] for a in admits])} |",
        f"| waited for a round boundary | - | {median([a['waited_s'] for a in admits])} |",
        f"| collective released (max over members) | {median([c['release_ms'] / 1000 for c in cuts])} | - |",
        f"| group formed (max over members) | {median([c['form_ms'] / 1000 for c in cuts])} | "
        f"{median([a['form_ms'] / 1000 for a in admits])} |",
        f"| detection/admission -> group re-formed | {median([c['formed_s'] for c in cuts])} | "
        f"{median([a['formed_s'] for a in admits])} |",
        f"| detection/admission -> first good round | {median([c['first_round_s'] for c in cuts])} | "
        f"{median([a['first_round_s'] for a in admits])} |",
        "",
        "why each cut: " + "; ".join(sorted({c["why"].split(" for ")[0] for c in cuts})),
    ]
    return lines


def throughput_report(run: Path, cpu: bool) -> list[str]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    full = [r["samples_per_s"] for r in records if r["world"] == 2]
    alone = [r["samples_per_s"] for r in records if r["world"] == 1]
    lines = [f"- epochs with 2 ranks: {len(full)}, with 1: {len(alone)} (the cut's own epoch is mixed)"]
    if full and alone:
        before, after = statistics.median(full[1:] or full), statistics.median(alone)
        lines.append(
            f"- samples/s: 2 ranks {before:,.0f}, 1 rank {after:,.0f}; retained "
            f"{after / (before / 2):.2f} of (survivors / world) x before"
            + (
                " (CPU: the ranks share two cores with whatever else runs there, so this swings from run to "
                "run and is no measure of what a GPU keeps)"
                if cpu
                else ""
            )
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=None, help="kills (default 10; --rank0: 3)")
    parser.add_argument("--every-s", type=float, default=None, help="seconds between kills (8; --churn: 20)")
    parser.add_argument("--heartbeat-s", type=float, default=None, help="heartbeat_timeout_s (survive's own)")
    parser.add_argument("--before", type=int, default=3, help="epochs before the throughput run's kill")
    parser.add_argument("--policy", default="cadence", choices=["sync", "cadence", "async"])
    parser.add_argument("--churn", action="store_true", help="a random rank killed every --every-s seconds")
    parser.add_argument("--rank0", action="store_true", help="rank 0 killed --kills times, every policy")
    parser.add_argument("--ranks", type=int, default=None, help="ranks (2; --churn and --rank0: 3)")
    parser.add_argument("--duration-s", type=float, default=200.0, help="--churn: how long it kills")
    parser.add_argument("--epochs", type=int, default=40, help="--rank0: epochs of each run")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument(
        "--arm",
        action="append",
        default=None,
        help="--churn: run the churned job once per --arm with these overrides added (space-separated), side "
        "by side between the same undisturbed runs: --arm launch.spare=true --arm launch.spare=false",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-survive"))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ranks = args.ranks or (3 if args.churn or args.rank0 else 2)
    start_method = "fork" if args.cpu else "spawn"
    if args.cpu:  # gloo ranks on the CPU, forked: a GPU the host has stays out of them (fork refuses CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    heartbeat = [f"heartbeat_timeout_s={args.heartbeat_s}"] if args.heartbeat_s else []
    task_given = any(override.startswith("task=") for override in args.overrides)
    device = ["device=cpu"] if args.cpu else [] if task_given else ["task=resnet"]
    common = [
        f"launch.nproc_per_node={ranks}",
        f"launch.start_method={start_method}",
        "fault_tolerance=survive",
        *heartbeat,
        *device,
        *args.overrides,
    ]
    stamp = int(time.time())
    if args.churn:
        lines = churn(args, common, ranks, stamp)
    elif args.rank0:
        lines = rank0(args, common, stamp)
    else:
        lines = kills_and_throughput(args, [*common, f"policy={args.policy}", "eval_every=0"], stamp)
    write_report(results_path(args.results_dir, "survive", args.cpu), "\n".join(lines))


def kills_and_throughput(args: argparse.Namespace, common: list[str], stamp: int) -> list[str]:
    kills, every_s = args.kills or 10, args.every_s or 8.0
    run, killed = launch(
        args.work,
        f"kills-{stamp}",
        [*common, "epochs=1000", f"launch.max_restarts={kills}"],
        timeout=kills * every_s + 240,
        kills=kills,
        every_s=every_s,
        kill_after_epochs=None,
    )
    lines = [
        "",
        f"## survive ({args.policy}): {kills} kills of rank 1, every {every_s:g} s",
        *environment_lines(args.cpu),
    ]
    lines += [f"- overrides: `{' '.join(common)}`", *kill_report(run, killed)]
    run2, _ = launch(
        args.work,
        f"throughput-{stamp}",
        [*common, f"epochs={args.before + 3}", "launch.max_restarts=0"],
        timeout=600,
        kills=1,
        every_s=0,
        kill_after_epochs=[args.before],
    )
    return [
        *lines,
        "",
        "### throughput retained (rank 1 killed once, not restarted)",
        *throughput_report(run2, args.cpu),
    ]


def churn(args: argparse.Namespace, common: list[str], ranks: int, stamp: int) -> list[str]:
    every_s = args.every_s or 20.0
    kills = args.kills or max(1, int(args.duration_s // every_s))
    job = [*common, f"policy={args.policy}", "eval_every=0", "epochs=100000"]
    # The undisturbed runs last as long as the churned one: a run's speed may drift over its minutes (see
    # bench/long_run.py), and a short calm run would not show it.
    calm_s = args.duration_s

    def calm(when: str) -> Path:
        return launch(
            args.work,
            f"calm-{when}-{stamp}",
            [*job, "launch.max_restarts=0"],
            timeout=calm_s + 300,
            kills=0,
            every_s=calm_s,
            kill_after_epochs=None,
        )[0]

    # Undisturbed before and after the churned run: a change in the machine's load between them shows.
    before = calm("before")
    arms = args.arm or [""]
    churned = {
        arm: launch(
            args.work,
            f"churn-{number}-{stamp}",
            [*job, *arm.split(), f"launch.max_restarts={kills}"],
            timeout=args.duration_s + 300,
            kills=kills,
            every_s=every_s,
            kill_after_epochs=None,
            victims=list(range(ranks)),
        )
        for number, arm in enumerate(arms)
    }
    after = calm("after")
    lines = [
        "",
        f"## survive ({args.policy}) under churn: {ranks} ranks, a random one killed every {every_s:g} s",
        *environment_lines(args.cpu),
        f"- overrides: `{' '.join(job)}`",
    ]
    for arm, (run, killed) in churned.items():
        lines += ["", f"### `{arm}`" if arm else "", *churn_report(run, killed, [before, after])]
    return lines


def rank0(args: argparse.Namespace, common: list[str], stamp: int) -> list[str]:
    kills = args.kills or 3
    lines = [
        "",
        f"## survive: rank 0 killed {kills} times in one run of {args.epochs} epochs, every policy",
        *environment_lines(args.cpu),
        f"- overrides: `{' '.join(common)}`",
        "",
        "| policy | kills | rank 0 cut | every epoch once | one final state | eval accuracy | undisturbed | "
        "points |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy in ("sync", "cadence", "async"):
        job = [*common, f"policy={policy}", f"epochs={args.epochs}"]
        name = f"rank0-{policy}-{stamp}"
        # Spread over the run by its records: the epochs of a small task on CPU are short.
        after = [(k + 1) * args.epochs // (kills + 1) for k in range(kills)]
        run, killed = launch(
            args.work,
            name,
            [*job, f"launch.max_restarts={kills}"],
            timeout=600,
            kills=kills,
            every_s=0,
            kill_after_epochs=after,
            victims=[0],
            run_out=True,
        )
        calm, _ = launch(
            args.work,
            f"calm-{name}",
            [*job, "launch.max_restarts=0"],
            timeout=600,
            kills=0,
            every_s=0,
            kill_after_epochs=None,
            run_out=True,
        )
        lines.append(rank0_report(args.work, name, run, calm, killed, policy))
    return lines


if __name__ == "__main__":
    main()
