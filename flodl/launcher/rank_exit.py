"""How a supervised rank's process ended (flodl/launcher/supervisor.py): its exit code or the signal that
killed it, and the failure of a run whose every rank ended before it."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from flodl.links.stop import STOP_SIGNALS


@dataclass(frozen=True)
class RankExit:
    """How one incarnation of a rank ended: an exit code, or the signal that killed it."""

    rank: int
    incarnation: int
    exitcode: int | None
    signal_name: str | None
    # The coordinator cut it (the supervisor killed it on the coordinator's word).
    cut: bool = False

    @property
    def cause(self) -> str:
        return f"exit code {self.exitcode}" if self.signal_name is None else f"signal {self.signal_name}"

    @property
    def stop_signal(self) -> int | None:
        """The stop signal this exit answers (exit code 128 + a stop signal, or killed by one), if any."""
        for signum in STOP_SIGNALS:  # a stopped rank exits 128 + the signal (flodl/links/stop.py)
            if self.exitcode == 128 + signum or self.signal_name == signal.Signals(signum).name:
                return signum
        return None


class SupervisedRankFailure(RuntimeError):
    """Every rank ended before the run did, and none can be started again."""

    def __init__(self, message: str, exits: list[RankExit]) -> None:
        super().__init__(message)
        # Every exit seen, as `supervise` returns them.
        self.exits = exits


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
