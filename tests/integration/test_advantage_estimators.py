"""`grpo train algo=rloo`: training takes RLOO's leave-one-out advantage from the config (objective/advantages.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY


def first_step(tmp_path, name, *overrides):
    run = tmp_path / name
    code, _, err = run_cli(["train", *TINY, "trainer.max_steps=1", "algo.beta=0", "sampler=default",
                            f"hydra.run.dir={run}", *overrides], cwd=tmp_path)
    assert code == 0, err
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_rloo_scales_the_unscaled_update_by_g_over_g_minus_1(tmp_path):
    # the same seed samples the same completions; with β = 0 and μ = 1 the gradient is linear in the advantages, and
    # RLOO's are G/(G-1) = 4/3 times Dr. GRPO's unscaled r - group mean (G = 4 in TINY)
    rloo = first_step(tmp_path, "rloo", "algo=rloo")
    centered = first_step(tmp_path, "centered", "algo.advantage_scale=none")
    assert rloo["reward"] == centered["reward"] and centered["grad_norm"] > 0
    assert rloo["grad_norm"] == pytest.approx(centered["grad_norm"] * 4 / 3, rel=1e-4)
