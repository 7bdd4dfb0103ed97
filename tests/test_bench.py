"""scripts/bench.py's floor arithmetic, against numbers worked by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parent.parent / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

# hidden 4, 1 layer, 2 heads of 2, 1 KV head, MLP 8, vocab 10
TOY = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, head_dim=2, num_key_value_heads=1,
                      intermediate_size=8, vocab_size=10)


def test_forward_flops_by_hand():
    shapes = bench.model_shapes(TOY)
    # per token: q 2*4*4 = 32, k+v 2*(2*4*2) = 32, o 32, gate+up 2*(2*4*8) = 128, down 2*8*4 = 64 -> 288;
    # attention 4 * 1 layer * 2 heads * 2 dims = 16 a context token; LM head 2*4*10 = 80
    assert shapes["attn_per_ctx"] == 16
    # 3 tokens at context 5 with the head: 3 * (288 + 16*5 + 80) = 1344; without: 3 * (288 + 80) = 1104
    assert bench.forward_flops(shapes, 3, 5, head=True) == 1344
    assert bench.forward_flops(shapes, 3, 5, head=False) == 1104


def test_floors_by_hand():
    probe = {"shapes": bench.model_shapes(TOY), "prompt_tokens": 10, "decode_flops_s": 1e3, "training_flops_s": 2e3}
    f = bench.floors(probe, completion=4)
    # prefill: 4 prompts * 10 tokens at context 5, no head: 40 * (288 + 80) = 14720 FLOPs, at 2e3/s = 7.36 s
    # decode: 32 rows * 4 tokens at context 10 + 2: 128 * (288 + 192 + 80) = 71680 FLOPs, at 1e3/s = 71.68 s
    assert f["rollout_s"] == pytest.approx(7.36 + 71.68)
    # update: 3 forwards' worth (reference, policy, backward) of both at the training rate: 3 * 86400 / 2e3
    assert f["update_s"] == pytest.approx(129.6)
    assert f["rollout_tok_s"] == pytest.approx(128 / 79.04)
    assert f["update_tok_s"] == pytest.approx(32 * 14 / 129.6)


def test_ours_twice_in_one_folder(tmp_path, monkeypatch):
    """A second `make bench` reruns our arm in the folder the first one left: the stale run is cleared first
    (`grpo train` refuses a folder that holds a run), and the numbers read are the new run's."""
    calls = []

    def fake_run(cmd, log, env=None):  # stands in for `grpo train`: refuses a used folder, writes 3 steps
        run_dir = Path(next(c for c in cmd if c.startswith("hydra.run.dir=")).split("=", 1)[1])
        if (run_dir / "metrics.jsonl").exists():
            raise SystemExit(f"{run_dir} already holds a run")
        run_dir.mkdir(parents=True)
        step_s = 10.0 * (len(calls) + 1)
        calls.append(run_dir)
        (run_dir / "metrics.jsonl").write_text("".join(
            f'{{"time/step_s": {step_s}, "time/rollout_s": 1.0, "time/update_s": 2.0, '
            f'"completions/mean_length": 50}}\n' for _ in range(3)))
        log.write_text("sampler: vLLM (installed)\n")
        return 1.0, 4.0

    monkeypatch.setattr(bench, "run", fake_run)
    a = SimpleNamespace(steps=3)
    first = bench.ours(a, "arithmetic", tmp_path, "arithmetic_ours_r1", [])
    second = bench.ours(a, "arithmetic", tmp_path, "arithmetic_ours_r1", [])
    assert (first["s_per_step"], second["s_per_step"]) == (10.0, 20.0)
    assert second["engine"] == "vLLM" and len(calls) == 2
