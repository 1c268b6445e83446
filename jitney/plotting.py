"""Matplotlib helpers shared by the simulator's and the load generator's figures.

Headless (Agg) so plots work on servers and in CI; imported lazily so the rest of jitney does not
pay for matplotlib."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, axes=(), legend_fontsize: int | None = None) -> Path:
    """Grid (and a legend where lines are labelled) on ``axes``, tight layout, write the PNG, free
    the figure."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return Path(path)
