"""Draw a simulated pipeline timeline as a PNG, like Fig. 4 of Narayanan et al. 2021.

One row per rank (rank 0 on top), time to the right. Each F or B is a box colored
by micro-batch, backward boxes darker, labeled with the micro-batch number; with
several chunks per rank, chunk c > 0 is hatched so interleaving is visible. Gaps
are the bubble. Needs matplotlib; it draws on an Agg canvas without pyplot, so no
global backend state is touched.
"""
from __future__ import annotations

from pathlib import Path

from megaft.pipeline.actions import ActionKind, chunk_of
from megaft.pipeline.simulate import SimResult

_HATCHES = ("", "//", "..", "xx", "\\\\", "++")
_DARKEN = 0.55  # backward shade: dark enough to tell apart, light enough to read the label


def plot_timeline(result: SimResult, path: str | Path, *, width: int = 1200,
                  height: int | None = None, dpi: int = 100, title: str | None = None) -> Path:
    """Write `result`'s compute timeline to `path` as a `width` x `height` pixel PNG.

    `height` defaults to 80 + 45 pixels per rank. Returns the path written.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgb
    from matplotlib.figure import Figure

    pp = result.pp
    height = height or 80 + 45 * pp
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    palette = colormaps["tab20"].colors
    span = result.makespan or 1.0
    px_per_unit = 0.85 * width / span  # the axes take ~85% of the figure width

    for rank, timeline in result.timelines.items():
        for start, end, action in timeline:
            if not action.kind.is_compute:
                continue
            # tab20 pairs a strong and a light tone; use the strong ones first.
            color = to_rgb(palette[(2 * action.microbatch) % 20 + (action.microbatch // 10) % 2])
            if action.kind is ActionKind.B:
                color = tuple(_DARKEN * c for c in color)
            chunk = chunk_of(action.stage, pp)
            ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=[color],
                           edgecolors="black", linewidth=0.4,
                           hatch=_HATCHES[chunk % len(_HATCHES)])
            label = str(action.microbatch)
            box_px = (end - start) * px_per_unit
            if box_px >= 7 * len(label):  # skip labels that would spill over the box
                ax.text((start + end) / 2, rank, label, ha="center", va="center",
                        fontsize=min(9, box_px / len(label) / 0.8),
                        color="white" if action.kind is ActionKind.B else "black")

    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top, as in the paper
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, span)
    ax.set_xlabel("time  (light: forward, dark: backward, number: micro-batch, hatch: chunk)")
    ax.set_title(title or f"pipeline timeline: bubble {result.bubble_fraction:.1%} of total time")
    fig.tight_layout()  # adjusts the axes only; the canvas keeps the requested size
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
