"""RUN/training.png at the end of a run: the key numbers of metrics.jsonl against the step
(matplotlib, imported only here and only when the plot is drawn)."""

from __future__ import annotations

import json
from pathlib import Path

# one panel's size and margins, in inches: a fixed layout, not tight_layout, which measured every tick label (a
# draw's worth of text layout) and left the figure a layout engine, so savefig drew it once more before the real draw
PANEL_WIDTH, HEIGHT = 4.0, 3.2
LEFT, RIGHT, BOTTOM, TOP = 0.62, 0.12, 0.5, 0.32  # y tick labels; the panel's edge; x ticks and "step"; the title
DPI = 110


def plot_training(run_dir: Path, keys: tuple[str, ...] = ("reward", "kl", "completions/mean_length")) -> Path | None:
    """RUN_DIR/training.png: each of `keys` against the step, from metrics.jsonl, and the held-out accuracy of the
    in-run evals (trainer.eval_every) with its Wilson 95% interval when the run has any."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    # the object API: no pyplot (its import, its figure registry) and no process-wide backend switch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("eval/accuracy") is not None]  # only the evaluated steps
    panels = [*keys, "eval/accuracy"] if evals else list(keys)
    width = PANEL_WIDTH * len(panels)
    fig = Figure(figsize=(width, HEIGHT))
    FigureCanvasAgg(fig)  # the PNG renderer, attached to this figure only (fig.canvas)
    # wspace is the gap between panels as a fraction of one axes' width
    fig.subplots_adjust(left=LEFT / width, right=1 - RIGHT / width, bottom=BOTTOM / HEIGHT, top=1 - TOP / HEIGHT,
                        wspace=(LEFT + RIGHT) / (PANEL_WIDTH - LEFT - RIGHT))
    for ax, key in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        rows = evals if key == "eval/accuracy" else records
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o" if rows is evals else ".")
        if rows is evals:
            ax.fill_between(steps, [r["eval/accuracy_low"] for r in rows], [r["eval/accuracy_high"] for r in rows],
                            alpha=0.2)
        ax.set_title("eval/accuracy (held-out, 95% interval)" if rows is evals else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=DPI)  # no figure registry to close it in: it goes with its last reference
    return out
