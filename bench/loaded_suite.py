"""The whole test suite, several times in a row, while a CPU burner keeps every core busy:
`python bench/loaded_suite.py [--runs 3] [--unloaded]`.

What a newcomer's `make test` meets on a shared or busy machine. The burner is one busy-looping process per
core (`os.cpu_count()`), at the same priority as the tests; `--unloaded` adds one run without it first, for
the suite's plain wall time. Each run is `python -m pytest -q -n <workers> --dist loadfile` with
`OMP_NUM_THREADS=1` (what `make test` runs; `--workers`, 2, is its WORKERS), its whole output kept in a
temporary dir the script names; its result line and wall time go to
bench/results/<date>-loaded-suite-<host>.md. The burners are stopped however the script ends.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, environment_lines, results_path, write_report


def _burn() -> None:
    while True:
        pass


def _suite(extra: list[str], log: Path) -> tuple[bool, float, str]:
    """One full pytest run, its whole output kept in `log` (a failure under load is read there afterwards):
    (passed, wall seconds, its summary line)."""
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    log.write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else f"exit code {done.returncode}"
    if done.returncode != 0:
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        summary += "; " + "; ".join(failed)
    return done.returncode == 0, wall, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="loaded runs in a row")
    parser.add_argument("--unloaded", action="store_true", help="one run without the burner first")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (make test's WORKERS)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. a test file)")
    args = parser.parse_args()
    pytest_args = ["-n", str(args.workers), "--dist", "loadfile", *args.pytest_args]

    rows = []
    logs = Path(tempfile.mkdtemp(prefix="flodl-loaded-suite-"))

    def run(name: str) -> None:
        log = logs / f"{name.replace(' ', '-').replace('/', '-of-')}.log"
        rows.append((name, *_suite(pytest_args, log)))
        print(f"{name}: {rows[-1][3]} ({rows[-1][2]:.0f} s; its output: {log})", flush=True)

    if args.unloaded:
        run("unloaded")
    burners = [mp.Process(target=_burn, daemon=True) for _ in range(os.cpu_count() or 1)]
    for burner in burners:
        burner.start()
    try:
        for i in range(args.runs):
            run(f"loaded {i + 1}/{args.runs}")
    finally:
        for burner in burners:
            burner.kill()
    lines = [
        f"## The test suite under a CPU burner ({len(burners)} busy processes)",
        *environment_lines(cpu=True),
        f"- command: `python -m pytest -q {' '.join(pytest_args)}` with OMP_NUM_THREADS=1",
        "",
        "| run | passed | wall | pytest's summary |",
        "|---|---|---|---|",
        *(
            f"| {name} | {'yes' if ok else '**no**'} | {t / 60:.1f} min | {said} |"
            for name, ok, t, said in rows
        ),
        "",
    ]
    write_report(results_path(REPO / "bench" / "results", "loaded-suite", cpu=True), "\n".join(lines))
    sys.exit(0 if all(ok for _, ok, _, _ in rows) else 1)


if __name__ == "__main__":
    main()
