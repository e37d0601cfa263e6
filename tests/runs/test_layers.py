"""The floors of flodl: imports run one way, down; no circle; the config's schema and rules stay off torch.

Every module's imports are read with ast, those inside functions too, so a change that opens a door up a
floor fails here. docs/architecture.md draws the same floors.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_a_fresh_interpreter_importing_the_rules_has_not_loaded_torch():
    """The package's own __init__ counts too: the ast walk above sees modules, this sees the process."""
    probe = "import sys, flodl.config.rules, flodl.config.schema; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
