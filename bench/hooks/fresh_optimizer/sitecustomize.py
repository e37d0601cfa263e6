"""A bench hook (bench/elastic.py --optimizer), loaded at start-up by a process with this folder on
PYTHONPATH: a rank without a part of its own in the checkpoint it resumes from starts with a fresh
optimizer (Adam's moments empty) instead of the saved rank's state the rule hands it, the learning rate and
schedule as the rule has them. What the rule is measured against."""

from __future__ import annotations

import logging
from typing import Any

from flodl.job import resume
from flodl.worker.stepper import Stepper

_restore = resume.restore_stepper


def _fresh_moments(stepper: Stepper, state: dict[str, Any]) -> None:
    _restore(stepper, state)
    if "rng" not in state:  # a partless rank's (shared_state keeps no RNG streams): its moments dropped
        stepper.parts.optimizer.state.clear()
        logging.getLogger("flodl").warning("this rank starts with a fresh optimizer (bench hook)")


resume.restore_stepper = _fresh_moments
