"""PNG plots: the run's timeline, and a multirun's jobs side by side (matplotlib, headless)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from flodl.metrics.sweep import Group, Job

ROUND_COLOR = "tab:red"


def plot_timeline(record: dict[str, Any], path: Path) -> Figure:
    """One lane per rank: training chunks as bars, averaging rounds as shaded bands, epochs as lines. A record
    read with only its last spans (`read_timeline(..., last=N)`) is drawn from where they begin (the title
    says so)."""
    world = record["world_size"]
    spans = record["spans"]
    totals = record.get("totals", {key: len(record[key]) for key in ("spans", "rounds")})
    since = spans[0]["start"] if totals["spans"] > len(spans) else -math.inf
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * world))
    for rank in range(world):  # one collection a lane: a bar each would take matplotlib minutes on a long run
        mine = [span for span in spans if span["rank"] == rank]
        ax.broken_barh(
            [(span["start"], span["end"] - span["start"]) for span in mine],
            (rank - 0.35, 0.7),
            facecolors=[plt.cm.tab10(span["epoch"] % 10) for span in mine],
        )
    rounds = [r for r in record["rounds"] if r["end"] is not None and r["end"] >= since]
    ax.broken_barh(
        [(r["start"], r["end"] - r["start"]) for r in rounds],
        (-0.6, world + 0.2),
        facecolors=ROUND_COLOR,
        alpha=0.25,
        linewidth=0,
    )
    epochs = [epoch["time"] for epoch in record["epochs"] if epoch["time"] >= since]
    ax.vlines(epochs, -0.6, world - 0.4, colors="black", linewidth=0.8, linestyles="--")
    for change in record["anchors"]:
        if change["time"] >= since:
            ax.annotate(f"anchor {change['from']}→{change['to']}", (change["time"], world - 0.5), fontsize=7)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_ylim(-0.6, world - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since start (the run's host's clock)")
    shown = "" if since == -math.inf else f", from {since:.0f} s (its last {len(spans):,} chunks)"
    ax.set_title(
        f"timeline — {totals['rounds']} averaging rounds (red), epochs (dashed), chunks by epoch{shown}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _by_epoch(jobs: list[Job], values: Callable[[Job], Sequence[float]], metric: str | None) -> _Curve:
    """Per epoch (the metric's epochs if given): the mean over the group's jobs of `values`, and of the
    metric (or of `values` itself) with its sample std. Seeds stopped early count where they have data."""
    rows: dict[int, list[tuple[float, float]]] = {}
    for job in jobs:
        for record, x in zip(job.records, values(job), strict=True):
            if metric is None:
                rows.setdefault(record["epoch"], []).append((record["epoch"], x))
            elif metric in record:
                rows.setdefault(record["epoch"], []).append((x, record[metric]))
    curve = _Curve([], [], [])
    for epoch in sorted(rows):
        xs, ys = zip(*rows[epoch], strict=True)
        curve.x.append(statistics.fmean(xs))
        curve.y.append(statistics.fmean(ys))
        curve.std.append(statistics.stdev(ys) if len(ys) > 1 else 0.0)
    return curve


@dataclass
class _Curve:
    x: list[float]
    y: list[float]
    std: list[float]

    def draw(self, ax: Axes, color: Any, label: str) -> None:
        ax.plot(self.x, self.y, marker="o", markersize=3, color=color, label=label)
        low = [m - s for m, s in zip(self.y, self.std, strict=True)]
        high = [m + s for m, s in zip(self.y, self.std, strict=True)]
        ax.fill_between(self.x, low, high, color=color, alpha=0.2, linewidth=0)


def plot_compare(groups: list[Group], metric: str, path: Path) -> Figure:
    """One colour per group (its seeds folded into a mean line and a ±1 std band): the metric against wall
    time since launch and against samples, throughput and bytes on the wire per epoch, and each group's wall
    time split into start-up, training and wind-down."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    (by_wall, by_samples, speed), (wire, split, legend_ax) = axes
    colors = [plt.cm.tab10(i % 10) for i in range(len(groups))]
    for group, color in zip(groups, colors, strict=True):
        label = group.label
        _by_epoch(group.jobs, lambda j: j.seconds_at(metric), metric).draw(by_wall, color, label)
        _by_epoch(group.jobs, lambda j: j.samples_at(metric), metric).draw(by_samples, color, label)
        _by_epoch(group.jobs, lambda j: [r["samples_per_s"] for r in j.records], None).draw(
            speed, color, label
        )
        _by_epoch(group.jobs, lambda j: [r["comm_bytes_total"] / 1e6 for r in j.records], None).draw(
            wire, color, label
        )
    for ax, xlabel, ylabel in (
        (by_wall, "seconds since launch (start-up included)", metric),
        (by_samples, "samples trained", metric),
        (speed, "epoch", "samples/s (all ranks)"),
        (wire, "epoch", "MB on the wire, cumulative"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    by_wall.set_title(f"{metric} against wall time")
    by_samples.set_title(f"{metric} against samples")
    speed.set_title("throughput")
    wire.set_title("bytes on the wire")
    if any(v > 0 for line in wire.get_lines() for v in line.get_ydata()):
        wire.set_yscale("symlog", linthresh=0.01)  # sync moves orders of magnitude more than local SGD
    shades = _plot_wall_split(split, groups, colors)
    handles, labels = by_wall.get_legend_handles_labels()
    seeds = sorted({len(g.jobs) for g in groups})
    legend_ax.axis("off")
    legend_ax.add_artist(
        legend_ax.legend(
            handles=shades, loc="lower center", fontsize=9, frameon=False, ncols=3, title="wall time bars"
        )
    )
    legend_ax.legend(
        handles,
        labels,
        loc="upper center",
        fontsize=10,
        frameon=False,
        title=f"mean ± 1 std (band) over seeds, n = {'/'.join(map(str, seeds))} per group",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _plot_wall_split(ax: Axes, groups: list[Group], colors: list[Any]) -> list[Patch]:
    """Per group, mean seconds of start-up, training and wind-down (launch to exit), each part labelled
    with its seconds where it is wide enough to hold them; returns the shades' legend entries."""
    parts = (
        ("start-up", "startup_s", 0.3),
        ("training", "training_s", 1.0),
        ("wind-down", "wind_down_s", 0.6),
    )
    widths = [[_mean_present([getattr(job, attr) for job in g.jobs]) for _, attr, _ in parts] for g in groups]
    longest = max((sum(w) for w in widths), default=0.0)
    for row, (width_row, color) in enumerate(zip(widths, colors, strict=True)):
        left = 0.0
        for width, (_, _, alpha) in zip(width_row, parts, strict=True):
            ax.barh(row, width, left=left, color=color, alpha=alpha, edgecolor="black", linewidth=0.5)
            if width > 0.08 * longest:
                ax.annotate(f"{width:.1f}s", (left + width / 2, row), ha="center", va="center", fontsize=8)
            left += width
    ax.set_yticks(range(len(groups)), [g.label for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds, launch to exit (mean over seeds)")
    ax.set_title("wall time: start-up | training | wind-down")
    ax.grid(alpha=0.3, axis="x")
    return [Patch(facecolor="grey", alpha=alpha, edgecolor="black", label=name) for name, _, alpha in parts]


def _mean_present(values: list[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else 0.0
