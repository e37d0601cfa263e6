"""A job that changes size under fault_tolerance=survive, on real processes and signals:
`python bench/elastic.py [--life] [--joins N] [--optimizer] [--cpu] [-- overrides]` (all three by default).

--life: a cadence job started with 2 self-launched ranks and `launch.max_ranks=4` grows to 3 and then 4
  (`flodl-join`, each once the last joiner is in), loses 2 (rank 1 and the last joiner SIGKILLed; neither is
  started again), is stopped (SIGTERM to its launcher: it saves) and resumed on 3 ranks to its last epoch;
  beside it the same job undisturbed on 2 ranks. Every epoch recorded once across the stop, each epoch's
  samples those of the undisturbed run (every sample once), one final state on the 3 ranks, both final
  accuracies.
--joins N: a job of 2 ranks (max 3) takes a joiner N times: it joins, trains until a round closed with it, and
  is SIGKILLed (its seat freed at once); per join, from the timeline: its start-up, ready -> admitted,
  admitted -> group formed, ready -> first round with it (median, p95).
--optimizer: a 2-rank checkpoint (epoch 2 of digits, cadence) resumed on 3 ranks, rank 2 partless: with the
  rule (saved rank 2 mod 2's optimizer state) against a fresh optimizer for rank 2 (Adam's moments empty, the
  same learning rate; a hook in bench/hooks/fresh_optimizer), `--repeats` interleaved pairs: the training
  loss of the first epochs after the resume.

    python bench/elastic.py --cpu                     # all three on CPU (gloo), digits
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
from pathlib import Path

from benchlib import REPO, environment_lines, results_path, write_report
from survive import both, rank_process

from flodl.metrics.timeline import read_timeline
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TRAIN,
    Child,
    child_env,
    finish,
    kill_group,
    start,
    wait_for,
)

# flodl-join as a module: a GPU machine runs the repo from source, with no installed entry point.
JOIN = [PYTHON, "-m", "flodl.launcher.join"]
CARD = Path(".launch") / "join.json"
FRESH_HOOK = REPO / "bench" / "hooks" / "fresh_optimizer"
FRESH_LINE = "starts with a fresh optimizer (bench hook)"
SURVIVE = ["fault_tolerance=survive", "policy=cadence", FAST_START, "heartbeat_timeout_s=3"]
# --life: epochs of digits (a fraction of a second each) between its changes.
PHASE = 20


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logs(run: Path) -> str:
    return "".join(path.read_text() for path in sorted(run.glob("*.log")))


def admitted(run: Path, rank: int, times: int = 1) -> bool:
    return len(re.findall(rf"rank {rank} admitted", logs(run))) >= times


def job(work: Path, name: str, overrides: list[str], env: dict[str, str] | None = None) -> tuple[Child, Path]:
    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    return start([PYTHON, TRAIN, *overrides, f"hydra.run.dir={run}"], work, child_env(**(env or {}))), run


def joiner(work: Path, run: Path) -> Child:
    return start([*JOIN, str(run)], work, child_env())


def kill(run: Path, rank: int) -> None:
    process = rank_process(run, rank)
    if process is None:
        raise RuntimeError(f"rank {rank} is not running")
    process.send_signal(signal.SIGKILL)


def final_accuracy(run: Path) -> float:
    return float(records(run)[-1]["eval/accuracy"])


def runs_of(worlds: list[int]) -> str:
    """`2 x 62, 3 x 72`: how many epochs in a row each world trained."""
    runs: list[list[int]] = []
    for world in worlds:
        if runs and runs[-1][0] == world:
            runs[-1][1] += 1
        else:
            runs.append([world, 1])
    return ", ".join(f"{world} ranks x {n}" for world, n in runs)


def states(text: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"rank (\d+): state after final round[^:]*: ([0-9a-f]+)", text)}


def life(args: argparse.Namespace, common: list[str]) -> list[str]:
    epochs = args.epochs
    grow = [*common, *SURVIVE, "launch.nproc_per_node=2", "launch.max_ranks=4", f"epochs={epochs}"]
    calm, calm_run = job(
        args.work,
        "life-calm",
        [*common, "policy=cadence", FAST_START, "launch.nproc_per_node=2", f"epochs={epochs}"],
    )
    proc, run = job(args.work, "life", grow)
    joiners: list[Child] = []
    try:
        wait_for(
            lambda: (run / CARD).is_file() and len(records(run)) >= PHASE, proc, 300, "a phase on 2 ranks"
        )
        joiners.append(joiner(args.work, run))
        wait_for(lambda: admitted(run, 2), proc, 300, "rank 2 was admitted")
        joiners.append(joiner(args.work, run))
        wait_for(lambda: admitted(run, 3), proc, 300, "rank 3 was admitted")
        grown = len(records(run))
        wait_for(lambda: len(records(run)) >= grown + PHASE, proc, 300, "a phase on 4 ranks")
        kill(run, 1)
        kill(run, 3)
        lost = len(records(run))
        wait_for(lambda: len(records(run)) >= lost + PHASE, proc, 300, "a phase on 2 ranks")
        proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler preempting the job does
        stopped = finish(proc, 120)
        at_stop = len(records(run))
        for j in joiners:
            finish(j, 60)
        resumed = finish(
            start(
                [
                    PYTHON,
                    TRAIN,
                    *common,
                    *SURVIVE,
                    "launch.nproc_per_node=3",
                    f"epochs={epochs}",
                    f"hydra.run.dir={run}",
                ],
                args.work,
                child_env(),
            ),
            900,
        )
        calm_done = finish(calm, 900)
    finally:
        for p in [proc, calm, *joiners]:
            if p.poll() is None:
                kill_group(p)
    resumed.check()
    calm_done.check()
    mine, theirs = records(run), records(calm_run)
    worlds = [r["world"] for r in mine]
    once = [r["epoch"] for r in mine] == list(range(epochs))
    same_samples = [r["samples"] for r in mine] == [r["samples"] for r in theirs]
    final = states(resumed.out)
    one_state = sorted(final) == [0, 1, 2] and len(set(final.values())) == 1
    calm_accuracy = final_accuracy(calm_run)
    return [
        "",
        f"## life: 2 -> 3 -> 4 ranks, 2 lost, stopped, resumed on 3 ({epochs} epochs)",
        *environment_lines(args.cpu),
        f"- overrides: `{' '.join(grow)}`",
        f"- epochs by world: {runs_of(worlds[:at_stop])}, stopped (exit code {stopped.code}) after epoch "
        f"{at_stop}, resumed: {runs_of(worlds[at_stop:])}",
        f"- every epoch recorded once across the stop: {once}; each epoch's samples the undisturbed run's: "
        f"{same_samples} ({theirs[0]['samples']} an epoch)",
        f"- one final state on the 3 resumed ranks: {one_state}",
        f"- final eval accuracy {final_accuracy(run):.4f}, undisturbed on 2 ranks {calm_accuracy:.4f}",
    ]


def joins(args: argparse.Namespace, common: list[str]) -> list[str]:
    overrides = [*common, *SURVIVE, "launch.nproc_per_node=2", "launch.max_ranks=3", "epochs=100000"]
    proc, run = job(args.work, "joins", overrides)
    try:
        wait_for((run / CARD).is_file, proc, 300, "the join card")
        for n in range(1, args.joins + 1):
            j = joiner(args.work, run)
            wait_for(lambda n=n: first_rounds(run) >= n, proc, 120, f"join {n}'s first round")
            kill(run, 2)
            finish(j, 60)
            wait_for(
                lambda n=n: len(re.findall(r"rank 2 cut out", logs(run))) >= n, proc, 300, f"join {n}'s cut"
            )
        proc.send_signal(signal.SIGTERM)
        finish(proc, 120)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    events = [e for e in read_timeline(run)["membership"] if e["event"] == "rank_admitted"]

    def column(key: str, other: str | None = None) -> list[float]:
        return [
            e[key] + (e[other] if other else 0.0)
            for e in events
            if e[key] is not None and (other is None or e[other] is not None)
        ]

    return [
        "",
        f"## joins: a rank joins a running 2-rank job {len(events)} times (SIGKILLed after its first round)",
        *environment_lines(args.cpu),
        f"- overrides: `{' '.join(overrides)}`",
        "",
        "| step | median / p95 (s) |",
        "|---|---|",
        f"| the joiner's start-up (its process to ready) | {both(column('startup_s'))} |",
        f"| ready -> admitted (the next round boundary) | {both(column('waited_s'))} |",
        f"| admitted -> group formed with it | {both(column('formed_s'))} |",
        f"| ready -> first round with it | {both(column('waited_s', 'first_round_s'))} |",
    ]


def first_rounds(run: Path) -> int:
    """Admissions whose first round closed (the coordinator's line for each)."""
    return len(re.findall(r"rank 2 admitted .*first good round", logs(run)))


def optimizer(args: argparse.Namespace, common: list[str]) -> list[str]:
    base = [*common, "policy=cadence", FAST_START, "checkpoint_every=1", "eval_every=0"]
    done, seed_run = job(args.work, "optimizer-seed", [*base, "launch.nproc_per_node=2", "epochs=2"])
    finish(done, 600).check()
    after = args.after
    losses: dict[str, list[list[float]]] = {"rule": [], "fresh": []}
    for repeat in range(args.repeats):
        for arm in ("rule", "fresh") if repeat % 2 == 0 else ("fresh", "rule"):
            run = args.work / f"optimizer-{arm}-{repeat}"
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(seed_run, run)
            hooked_path = os.pathsep.join([str(FRESH_HOOK), str(REPO), os.environ.get("PYTHONPATH", "")])
            env = {"PYTHONPATH": hooked_path} if arm == "fresh" else {}
            proc = start(
                [
                    PYTHON,
                    TRAIN,
                    *base,
                    "launch.nproc_per_node=3",
                    f"epochs={2 + after}",
                    f"hydra.run.dir={run}",
                ],
                args.work,
                child_env(**env),
            )
            finish(proc, 600).check()
            hooked = FRESH_LINE in (run / "rank2.log").read_text()
            if hooked != (arm == "fresh"):
                raise RuntimeError(
                    f"{run}: the fresh-optimizer hook {'did not apply' if arm == 'fresh' else 'applied'}"
                )
            losses[arm].append([r["loss"] for r in records(run)[2:]])
    rows = [
        f"| {e + 3} | {statistics.median(r[e] for r in losses['rule']):.4f} | "
        f"{statistics.median(r[e] for r in losses['fresh']):.4f} |"
        for e in range(after)
    ]
    return [
        "",
        f"## optimizer: a 2-rank checkpoint resumed on 3, rank 2's optimizer by the rule or fresh "
        f"({args.repeats} pairs)",
        *environment_lines(args.cpu),
        f"- overrides: `{' '.join(base)}`; checkpoint at epoch 2, resumed to epoch {2 + after}",
        "",
        "| epoch | training loss, rule (median) | fresh optimizer (median) |",
        "|---|---|---|",
        *rows,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--life", action="store_true")
    parser.add_argument("--joins", type=int, default=0, help="joins to time (default with no part named: 10)")
    parser.add_argument("--optimizer", action="store_true")
    parser.add_argument("--epochs", type=int, default=300, help="--life: the run's epochs")
    parser.add_argument("--repeats", type=int, default=3, help="--optimizer: interleaved pairs")
    parser.add_argument("--after", type=int, default=3, help="--optimizer: epochs after the resume")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-elastic"))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    if not (args.life or args.joins or args.optimizer):
        args.life, args.joins, args.optimizer = True, 10, True
    args.work.mkdir(parents=True, exist_ok=True)
    common = [*(["device=cpu"] if args.cpu else []), "task=digits", "batch_size=16", *args.overrides]
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # fork refuses a process that touched CUDA
    lines: list[str] = []
    if args.life:
        lines += life(args, common)
    if args.joins:
        lines += joins(args, common)
    if args.optimizer:
        lines += optimizer(args, common)
    write_report(results_path(args.results_dir, "elastic", args.cpu), "\n".join(lines))


if __name__ == "__main__":
    main()
