"""Tests that start no process (everything `-m 'not multiproc'` selects)."""
