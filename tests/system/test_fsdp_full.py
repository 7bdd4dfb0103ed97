"""trainer.fsdp=true with model.finetune=full end to end under torchrun: 2 steps + resume 2 = 4 straight, and the
same run as data parallelism (the spawned-rank cases are in tests/unit/test_fsdp_full_sharding.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint
from tests.helpers.ranks import TORCHRUN_TINY, torchrun
from tests.helpers.runs import deterministic

FULL = [*TORCHRUN_TINY, "model.finetune=full", "optimizer.lr=0.01", "trainer.max_steps=4"]


def _weights(run: Path, step: int) -> dict:
    return load_file(str(checkpoint.checkpoint_dir(run, step) / "model.safetensors"))


def _metrics(run: Path) -> list[dict]:
    return [deterministic(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]


# slow, not in CI: the 2-rank tests in tests/unit/test_fsdp_full_sharding.py hold the numbers; this is the
# command's own path (setup, save, resume)
@pytest.mark.slow
def test_torchrun_fsdp_full_resumes_exactly_and_trains_as_data_parallel(tmp_path):
    """4 steps on 2 ranks, every weight sharded, a checkpoint each step; steps 3-4 again from step 2's checkpoint;
    the same run as data parallelism (every rank holds the whole model: the same completions); step 2's checkpoint
    resumed in one process, where trainer.fsdp does nothing."""
    sharded, plain = tmp_path / "fsdp", tmp_path / "dp"
    done = torchrun(tmp_path, "train", *FULL, "trainer.fsdp=true", f"hydra.run.dir={sharded}")
    assert "fsdp: every weight, its gradient and optimizer state sharded over 2 ranks" in done.stderr
    straight, metrics = _weights(sharded, 4), _metrics(sharded)
    torchrun(tmp_path, "train", f"resume={checkpoint.checkpoint_dir(sharded, 2)}")
    again = _weights(sharded, 4)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    assert _metrics(sharded) == metrics  # losses, KL, grad norms of steps 3-4: bit for bit

    torchrun(tmp_path, "train", *FULL, f"hydra.run.dir={plain}")
    assert (sharded / "completions.jsonl").read_text() == (plain / "completions.jsonl").read_text()
    expected = _weights(plain, 4)
    for name in expected:  # float32 sums in another order (test_sharded_full_policy_takes_the_one_process_steps)
        assert torch.allclose(straight[name], expected[name], atol=1e-5, rtol=0), name
    for a, b in zip(metrics, _metrics(plain), strict=True):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a), a["step"]

    done = torchrun(tmp_path, "train", f"resume={checkpoint.checkpoint_dir(sharded, 2)}", ranks=1)
    assert "fsdp: one process, nothing to shard" in done.stderr
    assert len(_metrics(sharded)) == 4
