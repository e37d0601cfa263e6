"""Whether every rank sees the checkpoint dir of the run's host, before any rank trains.

Each rank writes its checkpoint parts into its own view of the checkpoint dir (`save_path`, else the run
dir) and the run's host commits them from its own. Hosts that do not share that dir (each torchrun agent its
own `hydra.run.dir`, or the same path on a local disk of each host) would write dirs of their own, and the
first commit would find a rank's part missing. So, with checkpoints on, the host leaves a mark of this start
in its checkpoint dir (a file named afresh each start) and publishes its name; once the store is up every
rank looks for it in its own view and publishes what it saw, and every rank reads what the others saw: one
that does not see the mark refuses the run on every rank, in one line naming the keys that fix it. With
checkpoints off no rank writes anything its host reads (the records are the host's, each rank's log is its
own), and nothing is checked.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from torch.distributed import PrefixStore

from flodl.checkpoints.disk import CheckpointDir
from flodl.config.rules import ConfigError
from flodl.links.group import publish_json, read_json

# The exchange's keys: the host's dir and mark, each rank's view of it, each rank's knowing it refuses.
_HOST_DIR = "checkpoint_dir"
_VIEW = "checkpoint_dir/{rank}"
_REFUSED = "checkpoint_dir/refused/{rank}"


@dataclass(frozen=True)
class View:
    """What one rank found of the host's mark: in which dir it looked (its own view of the checkpoint dir)."""

    rank: int
    sees: bool
    dir: str


def refusal(host_dir: str, views: list[View], checkpoint_keys: list[str]) -> str | None:
    """The line that refuses a run whose ranks do not all see the host's checkpoint dir (None: they do);
    `checkpoint_keys`: the keys that turn its checkpoints on. Pure."""
    blind = [view for view in views if not view.sees]
    if not blind:
        return None
    first = blind[0]
    who = f"rank {first.rank}" if len(blind) == 1 else "ranks " + ", ".join(str(v.rank) for v in blind)
    off = ", ".join(f"{key}=null" for key in checkpoint_keys)
    does = "does" if len(blind) == 1 else "do"
    return (
        f"{who} {does} not see the checkpoint dir {host_dir} of the run's host (rank {first.rank} looked in "
        f"{first.dir}): the hosts do not share it, and a checkpoint's parts would never meet; set "
        "save_path=<a dir on storage every host sees> (or give every host the same hydra.run.dir there), or "
        f"run without checkpoints: {off}"
    )


def mark_checkpoint_dir(exchange: PrefixStore, checkpoints: CheckpointDir | None) -> str | None:
    """The run's host, before any rank needs it: its checkpoint dir marked for this start and published
    (`checkpoints` None: checkpoints are off, nothing to share). The mark's name (`CheckpointDir.unmark`)."""
    if checkpoints is None:
        publish_json(exchange, _HOST_DIR, None)
        return None
    mark = f".host-{uuid.uuid4().hex}"
    checkpoints.mark(mark)
    publish_json(exchange, _HOST_DIR, {"dir": str(checkpoints.root), "mark": mark})
    return mark


def agree_on_checkpoint_dir(
    exchange: PrefixStore,
    rank: int,
    checked: list[int],
    checkpoints: CheckpointDir,
    checkpoint_keys: list[str],
    together: list[int],
) -> None:
    """Every rank: whether the ranks `checked` (each but one in the host's own process, which sees it) see
    the host's checkpoint dir, this one in `checkpoints` (its own view); ConfigError on every rank if one
    does not, once each rank of `together` knows it (the ranks whose store may go with one of them: the
    first to leave must not take the others' answer with it)."""
    host = read_json(exchange, _HOST_DIR)
    if host is None:
        return
    if rank in checked:
        seen = View(rank, checkpoints.marked(host["mark"]), str(checkpoints.root))
        publish_json(exchange, _VIEW.format(rank=rank), [seen.sees, seen.dir])
    try:
        ranks_see_it(exchange, checked, checkpoint_keys)
    except ConfigError:
        publish_json(exchange, _REFUSED.format(rank=rank), True)
        for other in together:
            read_json(exchange, _REFUSED.format(rank=other))
        raise


def ranks_see_it(exchange: PrefixStore, checked: list[int], checkpoint_keys: list[str]) -> None:
    """What the ranks `checked` saw of the host's mark (waits for each): ConfigError if one does not see
    it. The ranks ask it, and a host apart (survive), which then fails the run with their line."""
    host = read_json(exchange, _HOST_DIR)
    views = [View(r, *read_json(exchange, _VIEW.format(rank=r))) for r in checked]
    line = refusal(host["dir"], views, checkpoint_keys)
    if line is not None:
        raise ConfigError([line])
