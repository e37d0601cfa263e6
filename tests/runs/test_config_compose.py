"""Hydra composition of conf/ against the typed schema (flodl/config/schema.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_a_user_composes_flodl_conf_from_python_with_no_registration_call(tmp_path):
    """As a user's own tests of their configs would: a fresh interpreter elsewhere, `flodl.conf` as the
    config module, and nothing of flodl called first (its import registers the schema and resolvers)."""
    probe = (
        "from hydra import compose, initialize_config_module\n"
        "with initialize_config_module('flodl.conf', version_base='1.3'):\n"
        "    cfg = compose('config', overrides=['policy=async', 'gamma=0.5'], return_hydra_config=True)\n"
        "print(cfg.policy, cfg.gamma, cfg.hydra.run.dir.startswith('outputs/'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["async", "0.5", "True"]
