"""grpo_cli.metrics.plots: training.png holds a panel per key, and the held-out accuracy when the run has evals."""

from __future__ import annotations

import json

from PIL import Image

from grpo_cli.metrics.plots import plot_training


def _panels(run_dir) -> int:
    """Panels of RUN/training.png: each is 4 inches wide at 110 dpi (440 px)."""
    return round(Image.open(plot_training(run_dir)).size[0] / 440)


def test_the_held_out_accuracy_gets_a_panel_of_its_own_when_the_run_has_evals(tmp_path):
    steps = [{"step": n, "reward": 0.1 * n, "kl": 0.01, "completions/mean_length": 10} for n in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert _panels(tmp_path) == 3  # reward, kl, length
    steps[1].update({"eval/accuracy": 0.4, "eval/accuracy_low": 0.3, "eval/accuracy_high": 0.5})
    steps[3].update({"eval/accuracy": 0.6, "eval/accuracy_low": 0.5, "eval/accuracy_high": 0.7})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    assert _panels(tmp_path) == 4  # + held-out accuracy at steps 2 and 4
