"""RUN/training.png at the end of a run: the key numbers of metrics.jsonl against the step
(matplotlib, imported only here and only when the plot is drawn)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training(run_dir: Path, keys: tuple[str, ...] = ("reward", "kl", "completions/mean_length")) -> Path | None:
    """RUN_DIR/training.png: each of `keys` against the step, from metrics.jsonl, and the held-out accuracy of the
    in-run evals (trainer.eval_every) with its Wilson 95% interval when the run has any."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("eval/accuracy") is not None]  # only the evaluated steps
    panels = [*keys, "eval/accuracy"] if evals else list(keys)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, key in zip(axes, panels):
        rows = evals if key == "eval/accuracy" else records
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o" if rows is evals else ".")
        if rows is evals:
            ax.fill_between(steps, [r["eval/accuracy_low"] for r in rows], [r["eval/accuracy_high"] for r in rows],
                            alpha=0.2)
        ax.set_title("eval/accuracy (held-out, 95% interval)" if rows is evals else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
