"""RUN/training.png at the end of a run: the key numbers of metrics.jsonl against the step
(matplotlib, imported only here and only when the plot is drawn)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training(run_dir: Path, keys: tuple[str, ...] = ("reward", "kl", "completions/mean_length")) -> Path | None:
    """RUN_DIR/training.png: each of `keys` against the step, from metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        ax.plot([r["step"] for r in records], [r.get(key, float("nan")) for r in records], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
