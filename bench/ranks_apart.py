"""A survive job as it runs on several hosts, on this one: the run's host (`flodl-coordinator`) in this
network namespace, each rank's command started apart in a network namespace of its own, all on one bridge
(tests/helpers/netns), and started again whenever it ends, as a cluster's restart policy would (with
launch.max_restarts in the overrides, the command starts its rank again itself first). A rank's link taken
down is a network partition of that rank alone: its processes run on, their traffic is dropped
(bench/mixed_faults.py). Root only.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path

from tests.helpers.netns import make_bridged
from tests.helpers.procs import PYTHON, TRAIN, Child, child_env, finish, free_port, kill_group, start

# flodl-coordinator without its console script (a checkout on PYTHONPATH has none).
COORDINATOR = [PYTHON, "-c", "import sys; from flodl.cli import coordinator; sys.exit(coordinator())"]


class RanksApart:
    """`ranks` ranks of the job `overrides` (no launch.* keys: nothing launches them but this) writing to
    `run`. A context: the namespaces and every process are gone at its end."""

    def __init__(self, run: Path, work: Path, overrides: list[str], ranks: int) -> None:
        self.run, self.work, self.overrides, self.ranks = run, work, overrides, ranks
        self.restarts = 0

    def __enter__(self) -> RanksApart:
        """The namespaces made, the run's host started, then the ranks."""
        self.net = make_bridged(self.ranks)
        self.procs: dict[int, Child] = {}
        self.meet = {
            "WORLD_SIZE": str(self.ranks),
            "MASTER_ADDR": self.net.host_addr,
            "MASTER_PORT": str(free_port()),
        }
        try:
            self.host = start(
                [*COORDINATOR, *self.overrides, f"hydra.run.dir={self.run}"],
                cwd=self.work,
                env=child_env(GLOO_SOCKET_IFNAME=self.net.host_if, **self.meet),
            )
            self.procs = {r: self._rank(r) for r in range(self.ranks)}
        except BaseException:
            self.__exit__()
            raise
        return self

    def _rank(self, rank: int) -> Child:
        member = self.net.members[rank]
        env = child_env(RANK=str(rank), GLOO_SOCKET_IFNAME=member.ns_if, **self.meet)
        command = [*member.inside(), PYTHON, TRAIN, *self.overrides, f"hydra.run.dir={self.run}"]
        return start(command, cwd=self.work, env=env, output=subprocess.DEVNULL)

    def running(self) -> bool:
        """The run's host still runs; a rank that ended while it does is started again (a cut rank ends
        itself, non-zero, to be started again)."""
        if self.host.poll() is not None:
            return False
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                self.procs[rank] = self._rank(rank)
                self.restarts += 1
        return True

    def cut_off(self, rank: int) -> None:
        self.net.members[rank].down()

    def reconnect(self, rank: int) -> None:
        self.net.members[rank].up()

    def stop(self, timeout_s: float = 300) -> str:
        """SIGTERM to every process of the job, as a cluster's stop sends it; the host's output, once every
        process ended."""
        for proc in [self.host, *self.procs.values()]:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        out = finish(self.host, timeout_s).out
        for proc in self.procs.values():
            finish(proc, 60)
        return out

    def __exit__(self, *exc: object) -> None:
        for proc in [getattr(self, "host", None), *self.procs.values()]:
            if proc is None:
                continue
            if proc.poll() is None:
                kill_group(proc, grace=5)
        self.net.remove()
