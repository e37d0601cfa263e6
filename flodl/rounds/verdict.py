"""The guard's verdict on a reduce, which ElChe acts on when it settles a proposed anchor growth."""

from enum import Enum


class Verdict(Enum):
    # Training converges: a proposed anchor growth may be committed.
    STABLE = "stable"
    # Replicas drift apart: drop any growth and latch it off for a while.
    SUPPRESS_GROWTH = "suppress_growth"
    # Drift grows fast: also shrink the anchor.
    NUDGE_DOWN = "nudge_down"
