"""PNG charts for the benchmark results (matplotlib, optional: without it the PNG is skipped with a note)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Bar:
    label: str
    median: float
    low: float  # spread over repetitions: min
    high: float  # and max


def matplotlib_missing() -> str | None:
    """None when matplotlib imports, else why not (for the benchmark's output)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"matplotlib is not installed ({e}); pip install matplotlib to get the PNG"
    return None


def bar_panels(
    path: Path,
    title: str,
    panels: Sequence[tuple[str, str, Sequence[Bar]]],
    footnote: str = "",
    ncols: int = 2,
) -> Path | None:
    """One horizontal bar chart per (panel title, x-axis label, bars), in a grid of ``ncols`` columns; error bars show the spread.

    Returns the path written, or None when matplotlib is missing.
    """
    if matplotlib_missing():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in panels if p[2]]
    if not panels:
        return None
    ncols = min(ncols, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    height = max(2.5, 0.42 * max(len(p[2]) for p in panels) + 1.4)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, height * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (ptitle, xlabel, bars) in zip(flat, panels, strict=False):
        ys = list(range(len(bars)))
        meds = [b.median for b in bars]
        err = [
            [max(0.0, b.median - b.low) for b in bars],
            [max(0.0, b.high - b.median) for b in bars],
        ]
        colors = ["#d62728" if b.label.startswith("broker") else "#7f7f7f" for b in bars]
        ax.barh(ys, meds, xerr=err, color=colors, capsize=3)
        ax.set_yticks(ys)
        ax.set_yticklabels([b.label for b in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        for y, b in zip(ys, bars, strict=True):
            # Label past the whisker so the two never overlap.
            ax.text(max(b.high, b.median), y, f"  {b.median:,.0f}", va="center", fontsize=7)
        ax.margins(x=0.15)
    fig.suptitle(title, fontsize=11)
    if footnote:
        fig.text(0.01, 0.01, footnote, fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.04 if footnote else 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_panels(
    path: Path,
    title: str,
    panels: Sequence[tuple[str, str, str, dict[str, Sequence[tuple[float, float]]]]],
    footnote: str = "",
) -> Path | None:
    """One line chart per (panel title, x label, y label, {series: [(x, y), ...]}), side by side.

    Returns the path written, or None when matplotlib is missing."""
    if matplotlib_missing():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.2), squeeze=False)
    for ax, (ptitle, xlabel, ylabel, series) in zip(axes[0], panels, strict=True):
        for label, points in series.items():
            pts = sorted(p for p in points if p[1] == p[1])  # NaN: no figure at that x
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(ptitle, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    if footnote:
        fig.text(0.01, 0.01, footnote, fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.05 if footnote else 0, 1, 0.94))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
