"""scripts/loss_vs_trl.py: every loss_type equals TRL's own code (verl's for gmpo) within 1e-6, loss and gradient, and
algo.advantage=rloo verl's RLOO advantages.

Slow and optional: it needs TRL's scratch venv (../shared/bench/setup_trl_venv.sh, `make loss-vs-trl` makes it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

TRL_PYTHON = Path.home() / ".cache" / "grpo-bench" / "trlvenv" / "bin" / "python"


@pytest.mark.slow
def test_every_loss_type_equals_the_reference_implementation(tmp_path):
    if not TRL_PYTHON.exists():
        pytest.skip(f"no TRL scratch venv at {TRL_PYTHON}: make loss-vs-trl makes it")
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "loss_vs_trl.py"), "--batches", "50", "--json",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    table = json.loads(out.read_text())
    rows = table["losses"]
    assert {"cispo", "sapo", "gmpo"} <= set(rows) and rows["gmpo"]["reference"].startswith("verl")
    assert all(r["max_abs_dloss"] <= 1e-6 and r["max_abs_dgrad"] <= 1e-6 for r in rows.values())
    assert table["advantages"]["rloo"]["max_abs_dadv"] <= 1e-6
