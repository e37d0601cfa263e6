"""Pure round logic for local SGD (cadence and async): the window planner, ElChe, divergence guards."""
