"""Pure round logic for local SGD (cadence and async): the window planner, ElChe, the divergence guards and
their verdicts."""
