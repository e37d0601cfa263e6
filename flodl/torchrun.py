"""`flodl-torchrun` (`python -m flodl.torchrun`): torchrun, with the stops a flodl run makes quiet.

torchrun itself turns a Ctrl-C (or a scheduler's SIGTERM) into a traceback and exit code 1, and a rank that
stopped on a signal into a ChildFailedError report. Here the same arguments start the same torchrun; a stop
ends it with one line from rank 0 (where the run stopped, how to resume) and exit code 130 / 143 / 138
(SIGUSR1, which plain torchrun's agent does not forward: it dies of it). Any other
failure is reported as torchrun reports it.

    flodl-torchrun --nproc_per_node=2 -m flodl policy=cadence checkpoint_every=1
"""

from __future__ import annotations

import logging
import sys

from flodl.links.stop import STOP_EXIT_CODES, agent_takes_every_stop_signal


def _not_a_stop(record: logging.LogRecord) -> bool:
    """torch's agent logs a rank that exits 130 / 143 / 138 as failed, with a traceback: a stop is not."""
    err = record.exc_info[1] if record.exc_info else None
    return getattr(err, "exit_code", None) not in STOP_EXIT_CODES


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_a_stop)
    record(_torchrun)(argv)  # any other failure: torchrun's own report


def _torchrun(argv: list[str] | None) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    agent_takes_every_stop_signal()
    try:
        run(parse_args(argv))
    except SignalException as err:  # the agent got it, forwarded it and waited for the ranks
        sys.exit(128 + err.sigval)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if len(codes) == 1 and codes <= STOP_EXIT_CODES:  # a rank got it and every rank stopped on it
            sys.exit(codes.pop())
        raise


if __name__ == "__main__":
    main()
