"""``output_dir/loss.png``: the train and eval loss curves of a run, readable without VisualDL.

Drawn with matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), so
the process's global backend is never switched and no display is needed.  The
file is written next to its final name and moved into place, so a reader never
sees half a PNG.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Optional

LOSS_PLOT_NAME = "loss.png"


def write_loss_plot(path: str, train: Dict[int, float], evals: Dict[int, float], title: Optional[str] = None) -> str:
    """Train loss (line) and eval loss (markers) against the global step; returns ``path``.

    ``train`` / ``evals``: step -> loss.  With no point at all, or one train point (a run no longer
    than ``logging_steps``), the figure says so.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        steps = sorted(train)
        # a single logged loss is a dot, not an invisible line; the figure says how to get a curve
        ax.plot(
            steps,
            [train[s] for s in steps],
            label="train loss",
            color="tab:blue",
            linewidth=1.5,
            marker="o" if len(steps) == 1 else None,
        )
        if len(steps) == 1:
            ax.text(
                0.5,
                0.5,
                f"one train loss logged (step {steps[0]}): lower logging_steps for a curve",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
            )
    if evals:
        steps = sorted(evals)
        ax.plot(
            steps,
            [evals[s] for s in steps],
            label="eval loss",
            color="tab:orange",
            marker="o",
            linestyle="--" if len(steps) > 1 else "none",
        )
    if not train and not evals:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(loc="upper right")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".loss-", suffix=".png", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
