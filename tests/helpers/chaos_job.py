"""One fault-harness trial's job (tests/helpers/chaos.py): a 2-rank digits job started once or more in one run
dir, each start's ranks logging the sample ids of every step they train (tests/helpers/sample_log), and the
invariants checked from those ids and the run's own files. Each check adds the violations it finds to the
trial, named by their invariant (docs/checkpoints-and-faults.md#the-fault-harness says what each means)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from flodl.checkpoints.disk import rank_file, verify
from flodl.metrics.timeline import read_timeline
from tests.helpers.netns import Link, make_link
from tests.helpers.procs import PYTHON, REPO, TRAIN, Child, Result, child_env, finish, start, wait_for
from tests.helpers.runs import epochs_of
from tests.helpers.survive_runs import EPOCHS_AT_MOST, STOP_ONCE_ADMITTED

EPOCHS = 4
# Each step first waits this long (tests/helpers/held_steps): a ceiling on the pace on any machine.
STEP_S = 0.02
START_TIMEOUT_S = 180


@dataclass(frozen=True)
class Sample:
    """One step a rank trained: which start of the job, rank, process, epoch, its step count after it, ids."""

    start: int
    rank: int
    pid: int
    epoch: int
    step: int
    ids: tuple[int, ...]


@dataclass
class Trial:
    kind: str
    seed: int
    plan: str = ""
    violations: list[str] = field(default_factory=list)
    # Steps a dead process trained that the run dropped by design (after its last checkpoint under
    # fault_tolerance=none, since its last averaging round under survive): trained again by the others, or
    # under survive lost with it (docs/survive.md).
    retrained: int = 0
    lost: int = 0

    def violated(self, invariant: str, detail: str) -> None:
        self.violations.append(f"{invariant}: {detail}")


def read_samples(log_dir: Path) -> list[Sample]:
    found = []
    for path in sorted(log_dir.glob("*.jsonl")):
        start_tag, rank, pid = re.fullmatch(r"(\d+)-rank(\d+)-(\d+)\.jsonl", path.name).groups()  # type: ignore[union-attr]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found.append(
                Sample(int(start_tag), int(rank), int(pid), row["epoch"], row["step"], tuple(row["ids"]))
            )
    return found


class Job:
    """One trial's job across its starts: each start's ranks log their samples apart."""

    def __init__(self, work: Path) -> None:
        self.work, self.run_dir, self.log_dir = work, work / "run", work / "samples"
        work.mkdir(parents=True, exist_ok=True)
        self.args: list[str] = []
        self.procs: list[Child] = []
        self.checkpoints = self.run_dir / "checkpoints"  # save_path's, where a trial sets it
        self.mounts: list[Path] = []  # the file systems a trial mounted, unmounted at its end
        self.links: list[Link] = []  # the network namespaces a trial made, removed at its end
        self.starts = 0
        self.epochs: int | None = EPOCHS  # None: the run stops once a rank was admitted back

    def small_disk(self) -> Path:
        """A tmpfs of 4 MiB mounted for the checkpoints (a few of digits'), unmounted at the trial's end."""
        if os.geteuid() != 0:
            raise PermissionError("mounting the checkpoints' tmpfs needs root")
        disk = self.work / "disk"
        disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
        self.mounts.append(disk)
        self.checkpoints = disk / "checkpoints"
        return disk

    def link(self) -> Link:
        """A network namespace linked to this one (tests/helpers/netns), removed at the trial's end."""
        self.links.append(make_link())
        return self.links[-1]

    def configure(self, *overrides: str, apart: bool = False, until_admitted: bool = False) -> None:
        """The first start's command: 2 ranks of digits under `overrides` for EPOCHS epochs, launched by
        flodl; `apart`: the command of each rank started on its own (and, with COORDINATOR first, of the
        run's host); `until_admitted`: as many epochs as it takes, up to the one after a rank's admission."""
        launch = [] if apart else ["launch.start_method=fork", "launch.nproc_per_node=2"]
        self.epochs = None if until_admitted else EPOCHS
        epochs = [f"epochs={EPOCHS_AT_MOST}", STOP_ONCE_ADMITTED] if until_admitted else [f"epochs={EPOCHS}"]
        self.args = [PYTHON, TRAIN, *launch, "task=digits", *epochs, *overrides]
        self.args.append(f"hydra.run.dir={self.run_dir}")

    def start(
        self,
        args: list[str] | None = None,
        more: bool = False,
        inside: Link | None = None,
        env: dict[str, str] | None = None,
        hook: str = "sample_log",
    ) -> Child:
        """Start the job again (`args`: its command, this trial's first by default), or with `more` one more
        process of the current start (a rank started apart, `inside` a network namespace) with `env`.
        `hook`: the folder of tests/helpers whose sitecustomize the processes load (one that loads
        sample_log's)."""
        self.starts += not more
        hooks = os.pathsep.join([str(REPO / "tests" / "helpers" / hook), str(REPO)])
        environ = child_env(
            PYTHONPATH=hooks,
            FLODL_TEST_SAMPLE_LOG=str(self.log_dir),
            FLODL_TEST_SAMPLE_START=str(self.starts - 1),
            FLODL_TEST_STEP_S=str(STEP_S),
            **(env or {}),
        )
        command = [*(inside.inside() if inside else []), *(args or self.args)]
        self.procs.append(start(command, self.work, env=environ, errors=subprocess.PIPE))
        return self.procs[-1]

    def files(self, rank: int) -> list[Path]:
        """The sample logs of `rank`'s processes in the current start, oldest first."""
        found = self.log_dir.glob(f"{self.starts - 1}-rank{rank}-*.jsonl")
        return sorted(found, key=lambda p: p.stat().st_mtime_ns)

    def at_step(self, proc: subprocess.Popen, rank: int, steps: int) -> int:
        """Wait until `rank`'s live process of this start trained `steps` steps; its pid."""

        def reached() -> bool:
            files = self.files(rank)
            return bool(files) and len(files[-1].read_bytes().splitlines()) >= steps

        wait_for(reached, proc, START_TIMEOUT_S, f"rank {rank} trained {steps} steps")
        return int(self.files(rank)[-1].stem.rsplit("-", 1)[1])

    def finish(self, proc: Child, trial: Trial) -> Result:
        result = finish(proc, START_TIMEOUT_S)
        if result.timed_out:
            trial.violated("job-ended", f"start {self.starts - 1} timed out:\n{result.out[-2000:]}")
        return result


def check_each_sample_once(
    trial: Trial,
    job: Job,
    samples: list[Sample],
    window: set[Sample],
    may_lose: bool = False,
    unreported: dict[int, int] | None = None,
) -> None:
    """Every epoch's samples (as many as its record says) trained exactly once, the steps in `window` (a
    dead process's, whose training the run dropped by design) left out: each of their ids trained again
    once by the others, or (`may_lose`: lost with a survive rank) not at all, and then counted as trained.
    `unreported`: samples per epoch a dead rank trained that its record leaves out (a sharded group's)."""
    records = {
        r["epoch"]: r["samples"] + (unreported or {}).get(r["epoch"], 0) for r in epochs_of(job.run_dir)
    }
    kept: dict[int, Counter[int]] = defaultdict(Counter)
    for sample in samples:
        if sample not in window:
            kept[sample.epoch].update(sample.ids)
    dropped: dict[int, set[int]] = defaultdict(set)
    for sample in window:
        again = [kept[sample.epoch][i] for i in sample.ids]
        if any(n > 1 for n in again) or (not may_lose and any(n != 1 for n in again)):
            trial.violated("window-of-the-dead", f"{sample}: its ids trained {again} times again, not once")
        trial.retrained += all(n == 1 for n in again)
        trial.lost += all(n == 0 for n in again)
        dropped[sample.epoch].update(i for i in sample.ids if not kept[sample.epoch][i])
    for epoch, size in records.items():
        twice = sorted(i for i, n in kept[epoch].items() if n > 1)
        trained = len(kept[epoch]) + len(dropped[epoch])
        if trained != size or twice:
            trial.violated(
                "each-sample-once",
                f"epoch {epoch}: {trained} distinct ids of {size}, {len(twice)} trained more than once"
                f" (first {twice[:5]}{who_trained(samples, window, epoch, set(twice))})",
            )
    if set(kept) - set(records):
        trial.violated(
            "each-sample-once", f"epochs trained past the records: {sorted(set(kept) - set(records))}"
        )


def who_trained(samples: list[Sample], window: set[Sample], epoch: int, ids: set[int]) -> str:
    """Which processes trained `ids` of `epoch` (outside `window`), at which of their steps."""
    steps: dict[tuple[int, int], list[int]] = defaultdict(list)
    for sample in samples:
        if sample.epoch == epoch and sample not in window and ids & set(sample.ids):
            steps[(sample.rank, sample.pid)].append(sample.step)
    said = [f"rank {r} pid {p} steps {min(s)}-{max(s)}" for (r, p), s in sorted(steps.items())]
    return f", by {'; '.join(said)}" if said else ""


def check_run_end(trial: Trial, job: Job, result: Result) -> None:
    """The last start ended well: every epoch once, no `.partial` dir, model.pt the last checkpoint's."""
    if not result.ok:
        trial.violated("job-ended", f"exit {result.code}: {(result.err or result.out)[-1500:]}")
        return
    epochs = [r["epoch"] for r in epochs_of(job.run_dir)]
    if epochs != list(range(len(epochs) if job.epochs is None else job.epochs)):
        trial.violated("epochs-once", f"metrics.jsonl holds epochs {epochs}")
    check_no_partial(trial, job)
    checkpoints = job.checkpoints
    last = checkpoints / (checkpoints / "latest").read_text()
    model, saved = (torch.load(p, weights_only=True) for p in (job.run_dir / "model.pt", last / "model.pt"))
    if set(model) != set(saved) or any(not torch.equal(model[k], saved[k]) for k in model):
        trial.violated("model-is-consensus", f"model.pt differs from {last.name}'s model")


def check_no_partial(trial: Trial, job: Job) -> None:
    partial = sorted(p.name for p in job.checkpoints.glob("*.partial"))
    if partial:
        trial.violated("no-partial", f"left after start {job.starts - 1}: {partial}")


def parts_steps(checkpoint: Path) -> dict[int, int]:
    """Each rank's step count as its part in `checkpoint` holds it."""
    found = {}
    for rank in (0, 1):
        if (checkpoint / rank_file(rank)).is_file():
            part = torch.load(checkpoint / rank_file(rank), weights_only=True)
            found[rank] = part["stepper"]["steps_total"]
    return found


def last_steps(samples: list[Sample], start_tag: int) -> dict[int, int]:
    """Each rank's last step count in start `start_tag`."""
    last: dict[int, int] = {}
    for sample in samples:
        if sample.start == start_tag:
            last[sample.rank] = max(last.get(sample.rank, 0), sample.step)
    return last


def check_stopped(trial: Trial, job: Job, checkpoint: Path) -> None:
    """The stop's line names the committed checkpoint `latest` names, which holds every step trained."""
    check_no_partial(trial, job)
    if verify(checkpoint) is not None or (job.checkpoints / "latest").read_text() != checkpoint.name:
        trial.violated("stop-line", f"{checkpoint} is not the committed latest checkpoint")
        return
    held, trained = parts_steps(checkpoint), last_steps(read_samples(job.log_dir), job.starts - 1)
    if held != trained:
        trial.violated(
            "stop-lost-no-step", f"{checkpoint.name} holds steps {held}, the ranks trained {trained}"
        )


def check_ranks_end(trial: Trial, job: Job) -> None:
    """The ranks of a host killed end on their own within a minute (they are killed past it)."""
    pids = [int(path.stem.rsplit("-", 1)[1]) for rank in (0, 1) for path in job.files(rank)]
    ranks = [process for process in map(_alive, pids) if process is not None]
    _, alive = psutil.wait_procs(ranks, timeout=60)
    if alive:
        trial.violated("ranks-end", f"ranks {[r.pid for r in alive]} outlived their host by a minute")
        for rank in alive:
            rank.kill()


def _alive(pid: int) -> psutil.Process | None:
    try:
        process = psutil.Process(pid)
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def check_failure_line(trial: Trial, job: Job, result: Result) -> Path | None:
    """The failed job's last line names the committed checkpoint `latest` names (or says none was written):
    the one resume=auto goes on from. That checkpoint."""
    lines = result.err.strip().splitlines()
    named = re.search(r"the last checkpoint is ([^;\s]+)", lines[-1]) if lines else None
    latest = job.checkpoints / "latest"
    committed = latest.parent / latest.read_text() if latest.is_file() else None
    said = Path(named.group(1)) if named else None
    if said != committed or (committed and verify(committed) is not None):
        trial.violated("last-line", f"says {lines[-1:]!r}, latest is {committed}")
    return committed


def window_of_the_dead(
    trial: Trial, job: Job, samples: list[Sample], victim: int, pid: int, cut_with: int | None = None
) -> set[Sample]:
    """The steps of the dead (or frozen) process `pid` of rank `victim` past the last round that averaged
    them, as the run's timeline counts its steps in the rounds before its cut: by design lost with it, or
    handed to the others again (either way each of their ids may be trained once more). Its steps before must
    all be its own. `cut_with`: the rank whose cut took `victim` out too (its sharded group's)."""
    timeline = read_timeline(job.run_dir)
    cut_rank = victim if cut_with is None else cut_with
    cut = next(
        e["time"] for e in timeline["membership"] if e["event"] == "rank_cut" and e["rank"] == cut_rank
    )
    averaged = sum(r["steps"].get(str(victim), 0) for r in timeline["rounds"] if r["end"] <= cut)
    own = [s for s in samples if s.pid == pid]
    if averaged > len(own):
        trial.violated(
            "window-of-the-dead", f"rounds averaged {averaged} steps of pid {pid}, it trained {len(own)}"
        )
    return {s for s in own if s.step > averaged}
