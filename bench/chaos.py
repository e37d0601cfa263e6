"""The fault harness at length (issue 54): many trials per fault kind, each a 2-rank digits job on CPU (gloo,
forked ranks) with one fault at moments drawn from its seed, checked against the invariants of
tests/helpers/chaos.py (the trial runner the CI lane tests/runs/test_chaos.py runs too). Prints, and appends
to bench/results/<date>-chaos-<hardware>.md, per fault kind: trials, violations (goal: 0) and which
invariant, the steps the run dropped by design (trained again, or lost with a survive rank), each violating
trial's seed and plan.

    python bench/chaos.py --trials 40 --kinds stop,kill,survive-kill,freeze,host-kill --seed 0
    python bench/chaos.py --trials 10 --kinds partition --seed 0   # root: a network namespace a trial
    python bench/chaos.py --trials 200                       # the issue's count (hours on 2 CPU cores)

Trial i of a kind has seed S + i: `--seed S --trials 1 --kinds K` runs a violation's plan again (the same
policy, schedule, rank, step and signal; not the same interleaving of the processes around it); each trial's
dirs are kept under --work.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

from benchlib import REPO, environment_lines, results_path, write_report

from tests.helpers.chaos import KINDS, run_trial
from tests.helpers.chaos_job import EPOCHS, Trial


def report(trials: list[Trial], kinds: list[str], args: argparse.Namespace, took_s: float) -> str:
    lines = [
        f"## chaos: {len(trials)} trials, seeds {args.seed}..{args.seed + args.trials - 1} per kind",
        "",
        *environment_lines(cpu=True),
        f"- 2 gloo ranks, digits, {EPOCHS} epochs, forked ranks (partition: ranks started apart beside"
        " flodl-coordinator, the run stopped once the restarted rank is admitted);"
        f" {took_s / 60:.1f} min in all",
        "",
        "| fault kind | trials | violations | invariants violated | steps trained again | steps lost |",
        "|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        of_kind = [t for t in trials if t.kind == kind]
        bad = [t for t in of_kind if t.violations]
        names = Counter(v.split(":", 1)[0] for t in bad for v in t.violations)
        named = ", ".join(f"{name} ({n})" for name, n in sorted(names.items())) or "—"
        again, lost = sum(t.retrained for t in of_kind), sum(t.lost for t in of_kind)
        lines.append(f"| {kind} | {len(of_kind)} | {len(bad)} | {named} | {again} | {lost} |")
    bad = [t for t in trials if t.violations]
    if bad:
        lines += ["", "Violating trials:", ""]
        lines += [f"- {t.kind} seed {t.seed} ({t.plan}): {'; '.join(t.violations)[:600]}" for t in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10, help="trials per fault kind")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--seed", type=int, default=0, help="the first trial's seed")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-chaos"))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; known: {', '.join(KINDS)}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU, forked: fork refuses CUDA
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started, trials = time.monotonic(), []
    for i in range(args.trials):  # kinds interleaved: a run cut short still covers each
        for kind in kinds:
            trial = run_trial(args.work / f"{kind}-{args.seed + i}", kind, args.seed + i)
            trials.append(trial)
            print(f"{kind} seed {trial.seed}: {trial.plan}: {trial.violations or 'ok'}", flush=True)
    write_report(
        results_path(args.results_dir, "chaos", cpu=True),
        report(trials, kinds, args, time.monotonic() - started),
    )


if __name__ == "__main__":
    main()
