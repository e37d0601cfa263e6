"""PNG plots: the run's timeline, and a multirun's jobs side by side (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

ROUND_COLOR = "tab:red"


def plot_timeline(record: dict[str, Any], path: Path) -> Figure:
    """One lane per rank: training chunks as bars, averaging rounds as shaded bands, epochs as lines."""
    world = record["world_size"]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * world))
    for span in record["spans"]:
        color = plt.cm.tab10(span["epoch"] % 10)
        ax.broken_barh(
            [(span["start"], span["end"] - span["start"])], (span["rank"] - 0.35, 0.7), color=color
        )
    for entry in record["rounds"]:
        if entry["end"] is not None:
            ax.axvspan(entry["start"], entry["end"], color=ROUND_COLOR, alpha=0.25, linewidth=0)
    for epoch in record["epochs"]:
        ax.axvline(epoch["time"], color="black", linewidth=0.8, linestyle="--")
    for change in record["anchors"]:
        ax.annotate(f"anchor {change['from']}→{change['to']}", (change["time"], world - 0.5), fontsize=7)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_ylim(-0.6, world - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start (rank 0's clock)")
    ax.set_title(
        f"timeline — {len(record['rounds'])} averaging rounds (red), epochs (dashed), chunks by epoch"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def plot_compare(jobs: list[dict[str, Any]], metric: str, path: Path) -> Figure:
    """`metric` per epoch against wall time, step and bytes on the wire, one line per job."""
    axes_of = (("wall_s", "wall time (s)"), ("step", "step"), ("comm_bytes_total", "bytes on the wire"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for job in jobs:
        points = [r for r in job["records"] if metric in r]
        for ax, (key, _) in zip(axes, axes_of, strict=True):
            ax.plot([p[key] for p in points], [p[metric] for p in points], marker="o", label=job["label"])
    for ax, (_, label) in zip(axes, axes_of, strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
