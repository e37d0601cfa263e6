"""Child processes in their own process group, always cleaned up: flodl's CLI for tests and benchmarks.

bench/benchlib.py imports this module too (it puts the repo on sys.path first): one runner for both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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


def child_env(**extra: str) -> dict[str, str]:
    """This environment, the repo on PYTHONPATH, one OpenMP thread, Hydra's full tracebacks; then `extra`."""
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "HYDRA_FULL_ERROR": "1"})
    env.update(extra)
    return env


def start(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    output: int = subprocess.PIPE,
    errors: int = subprocess.STDOUT,
) -> subprocess.Popen:
    """Start `args` as the leader of a new process group, so that its launcher and ranks stop together.
    `errors`: where stderr goes (with stdout by default; PIPE keeps it apart)."""
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=child_env() if env is None else env,
        stdout=output,
        stderr=errors,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate `proc`'s process group, give the leader `grace` seconds, then kill what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


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


def leftovers(cwd: Path) -> list[str]:
    """Processes still running in `cwd` (the ranks of a finished run must all be gone)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and Path(proc.cwd()) == cwd:
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return found


def free_port() -> int:
    """A port nothing listens on now (for a store a test's ranks rendezvous at)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
