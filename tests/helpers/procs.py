"""Child processes in their own process group, always cleaned up: flodl's CLI for tests and benchmarks.

bench/benchlib.py imports this module too (it puts the repo on sys.path first): one runner for both.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil
import torch

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
TRAIN = str(REPO / "train.py")
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]
# Forked ranks start fastest; a host with a GPU must spawn them (flodl refuses fork there: a forked rank
# inherits the launcher's CUDA driver state and fails at its first CUDA call, even with device=cpu).
FAST_START = f"launch.start_method={'spawn' if torch.cuda.device_count() else 'fork'}"


@dataclass
class Result:
    code: int
    # stdout, and stderr too unless it was kept apart (then in `err`).
    out: str
    timed_out: bool = False
    err: str = ""

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.timed_out

    def check(self) -> Result:
        assert self.ok, f"exit code {self.code}:\n{self.out[-6000:]}"
        return self


def held_rounds_env(delay_s: float, **extra: str) -> dict[str, str]:
    """What a run's processes need to load tests/helpers/slow_round's hook: every cpu-backend round held back
    `delay_s` on its thread (a slow link's stand-in); `extra`: the hook's other switches."""
    hook = REPO / "tests" / "helpers" / "slow_round"
    return {
        "FLODL_TEST_ROUND_DELAY_S": str(delay_s),
        "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]),
        **extra,
    }


def child_env(**extra: str) -> dict[str, str]:
    """This environment, the repo on PYTHONPATH, one OpenMP thread, Hydra's full tracebacks; then `extra`. A
    PYTHONPATH in `extra` (a test hook's folder) comes before this environment's, which stays: where the
    dependencies are installed apart (the GPU machines' wheels), the children find them too."""
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(REPO), inherited) if p)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "HYDRA_FULL_ERROR": "1"})
    env.update(extra)
    if "PYTHONPATH" in extra and inherited:
        env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], inherited])
    return env


class Child(subprocess.Popen):
    """A child whose output goes to files, not pipes: a job that logs more than a pipe holds (64 KiB) while
    nobody reads it would block on its next line and stall; `communicate` reads the files once it ended."""

    def __init__(
        self, args: list[str], cwd: Path, env: dict[str, str], output: int | None, apart: bool
    ) -> None:
        # Appended to, so that reading the output as the child writes moves no write position; open for as
        # long as the Child is (its output may be read more than once).
        self.out_file = tempfile.TemporaryFile("ab+") if output is None else None  # noqa: SIM115
        self.err_file = tempfile.TemporaryFile("ab+") if apart else None  # noqa: SIM115
        stderr = self.err_file if apart else subprocess.STDOUT if output is None else output
        super().__init__(
            args, cwd=cwd, env=env, stdout=self.out_file or output, stderr=stderr, start_new_session=True
        )

    def communicate(self, input: object = None, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (TimeoutExpired past `timeout`); its stdout and stderr (stderr: "" unless kept
        apart)."""
        assert input is None, "a Child reads nothing"
        self.wait(timeout)
        return _read(self.out_file), _read(self.err_file)


def _read(file: IO[bytes] | None) -> str:
    if file is None:
        return ""
    file.seek(0)
    return file.read().decode(errors="replace")


def wait_for(
    happened: Callable[[], bool], proc: subprocess.Popen, timeout: float = 180, what: str = "the event"
) -> None:
    """Wait until `happened()` (an event the job leaves behind: a file, a log line), while the job runs."""
    deadline = time.monotonic() + timeout
    while not happened():
        assert proc.poll() is None, f"the job ended before {what}:\n{proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(0.05)


def wait_for_path(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until `path` exists (a checkpoint committed, a part being written), while the job runs."""
    wait_for(path.exists, proc, timeout, f"{path} appeared")


def start(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    output: int | None = None,
    errors: int = subprocess.STDOUT,
) -> Child:
    """Start `args` as the leader of a new process group, so that its launcher and ranks stop together.
    Its output is kept (`output`: subprocess.DEVNULL drops it); `errors`: subprocess.PIPE keeps stderr
    apart from stdout."""
    return Child(args, cwd, child_env() if env is None else env, output, apart=errors == subprocess.PIPE)


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate `proc`'s process group, give the leader `grace` seconds, then kill what is left of it and of
    its process tree (torchrun's ranks have process groups of their own: SIGKILLed, their agent would leave
    them running)."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def kill_left(procs: list[subprocess.Popen]) -> None:
    """A test's cleanup: the process group of each of `procs` still running, killed."""
    for proc in procs:
        if proc.poll() is None:
            kill_group(proc)


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    """Wait for `proc` and its output; past `timeout`, kill its group and return what it wrote, timed out."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return Result(proc.returncode, out, timed_out=True, err=err or "")
    return Result(proc.returncode, out, err=err or "")


def run(args: list[str], cwd: Path, timeout: float = 180, apart: bool = False, **env: str) -> Result:
    """Run `args` to its end; a timeout kills the whole process group and fails the test. `apart`: stderr
    in `Result.err`, not mixed into `out`."""
    errors = subprocess.PIPE if apart else subprocess.STDOUT
    result = finish(start(args, cwd, child_env(**env), errors=errors), timeout)
    if result.timed_out:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(args)}\n{result.out[-6000:]}")
    return result


def train(*overrides: str, cwd: Path, timeout: float = 180, apart: bool = False, **env: str) -> Result:
    return run([PYTHON, TRAIN, *overrides], cwd=cwd, timeout=timeout, apart=apart, **env)


def torchrun(nproc: int, *overrides: str, cwd: Path, timeout: float = 180, **env: str) -> Result:
    args = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", TRAIN, *overrides]
    return run(args, cwd=cwd, timeout=timeout, **env)


def leftovers(cwd: Path, grace_s: float = 60.0) -> list[str]:
    """Processes running in `cwd` that do not end within `grace_s` (the ranks of a finished run must all be
    gone; a helper its launcher started, such as multiprocessing's resource tracker, ends on its own once the
    launcher is gone, later on a loaded machine: it is waited for, not raced)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and Path(proc.cwd()) == cwd:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    _, alive = psutil.wait_procs(found, timeout=grace_s)
    return [f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}" for proc in alive]


# Ports for stores a test's ranks meet at: below the kernel's ephemeral range (32768 up on Linux), which the
# other tests' outgoing connections and bind(0) servers draw from, a span per pytest-xdist worker.
_PORTS_FROM, _PORTS_PER_WORKER = 10_000, 2_000


def free_port() -> int:
    """A port nothing listens on now, for a store a test's ranks meet at once they started (seconds later):
    no other test running beside it, in this worker or another, can take it in between."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = _PORTS_FROM + worker * _PORTS_PER_WORKER
    for port in random.sample(range(first, first + _PORTS_PER_WORKER), _PORTS_PER_WORKER):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + _PORTS_PER_WORKER - 1}")
