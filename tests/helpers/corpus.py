"""A tiny stand-in for the Python standard library's folder: the text tasks' corpus in tests."""

from __future__ import annotations

from pathlib import Path


def fake_library(root: Path, files: int) -> None:
    """`files` small modules in three packages under `root` (which is made), and a site-packages file that is
    no part of the corpus."""
    for i in range(files):
        folder = root / f"pkg{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i}.py").write_bytes(f"# module {i}\n".encode() * (i + 1))
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.py").write_text("not the stdlib\n")
