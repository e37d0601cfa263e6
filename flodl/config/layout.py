"""The world a run is laid out for: how many ranks, each stepping how many samples, hence its global batch.

A fresh run is laid out for its own world; a run resumed with keep_global_batch (sync) keeps the layout of
the checkpoint it resumes, each of its ranks stepping as many micro-batches as make that global batch up
(flodl/job/resize.py). The run's host builds the layout once, with its choice of checkpoint, and publishes
it with that choice (flodl/job/resume.py): the coordinator plans with it and records it in each checkpoint
(one key, `layout`, of the coordinator's state), and every rank scales its learning rate by it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Layout:
    # The ranks the run is laid out for, and samples of a rank's optimizer step among them.
    world: int
    step: int
    # keep_global_batch: the global batch stays when the world changes (a resize, a cut, an admission),
    # else it follows the world.
    kept: bool = False

    @property
    def global_batch(self) -> int:
        return self.world * self.step

    def world_of(self, members: int, step: int) -> int:
        """The global batch of `members` ranks stepping `step` samples each, in ranks of this layout's step:
        the world the learning rate is scaled for."""
        return members * step // self.step

    def member_step(self, members: int, batch_size: int) -> int | None:
        """Each of `members` ranks' step that makes up the global batch in whole micro-batches of
        `batch_size`; None: it does not divide."""
        per_member, left = divmod(self.global_batch, members)
        if left or per_member == 0 or per_member % batch_size:
            return None
        return per_member

    def at(self, members: int) -> Layout:
        """The layout of a checkpoint of `members` ranks: this one where the global batch is kept, else the
        members' own (the global batch followed them)."""
        return self if self.kept else replace(self, world=members)

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Layout:
        return cls(int(state["world"]), int(state["step"]), bool(state["kept"]))

    @classmethod
    def saved(cls, coordinator: dict[str, Any], members: int, step: int, kept: bool) -> Layout:
        """The layout a checkpoint recorded (its coordinator's state, `members` parts), kept or not as this
        run says. A checkpoint of an older flodl recorded a rank's step of its world (`step_samples`, else
        as configured now: `step`) and under keep_global_batch of the world first laid out for
        (`layout_step`): its global batch was its members' steps."""
        if coordinator.get("layout") is not None:
            return replace(cls.from_state(coordinator["layout"]), kept=kept)
        own = int(coordinator.get("step_samples") or step)
        first = int(coordinator.get("layout_step") or own)
        return cls(members * own // first, first, kept)
