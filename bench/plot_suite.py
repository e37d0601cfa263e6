"""Bar chart of a GPU suite result: throughput per arm, plain torch in grey, flodl in colour.

    python bench/plot_suite.py bench/results/2026-11-30-suite-gpt_nano-nvlink-2x-NVIDIA-H200.md

Reads the arms table that bench/gpu_suite.py writes (the last one in the file) and saves a .png beside it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def arms_table(text: str) -> list[tuple[str, float]]:
    """(arm, samples/s) rows of the last arms table in a suite result file."""
    tables: list[list[tuple[str, float]]] = []
    inside = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["arm", "samples/s"]:
            tables.append([])
            inside = True
        elif inside and line.startswith("|") and not cells[0].startswith("---"):
            tables[-1].append((cells[0], float(cells[1].replace(",", ""))))
        elif not line.startswith("|"):
            inside = False
    if not tables or not tables[-1]:
        raise SystemExit("plot_suite: no arms table (| arm | samples/s | ...) in the file")
    return tables[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path)
    args = parser.parse_args()
    rows = arms_table(args.result.read_text())
    names = [name for name, _ in rows]
    values = [value for _, value in rows]
    colours = ["0.6" if name.startswith("plain torch") else "tab:blue" for name in names]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1))
    ax.barh(names[::-1], values[::-1], color=colours[::-1])
    for y, value in enumerate(values[::-1]):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("samples/s (higher is better)")
    ax.set_title(args.result.stem)
    fig.tight_layout()
    out = args.result.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
