"""Helpers shared by the test modules (and, for procs, by bench/): no test module imports another."""
