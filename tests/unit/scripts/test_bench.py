"""scripts/bench.py's floor arithmetic, against numbers worked by hand."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.scripts import load_script

bench = load_script("bench")

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


def test_the_compiled_arm_passes_the_setting_and_reads_its_compile(tmp_path, monkeypatch):
    """`--arms ours_compiled` runs `grpo train` with trainer.compile=true; step 1 (the compile's) stays out of s/step
    and its seconds, and the compile's from the run's own line, come back beside it."""
    seen = []

    def fake_run(cmd, log, env=None):
        seen.append(cmd)
        run_dir = Path(next(c for c in cmd if c.startswith("hydra.run.dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(
            f'{{"time/step_s": {s}, "time/rollout_s": 1.0, "time/update_s": 2.0, "completions/mean_length": 50}}\n'
            for s in (90.0, 12.0, 14.0)))
        log.write_text("sampler: vLLM (installed)\ncompiled the update in 37 s\n")
        return 1.0, 3.0

    monkeypatch.setattr(bench, "run", fake_run)
    res = bench.ours(SimpleNamespace(steps=3), "gsm8k", tmp_path, "gsm8k_ours_compiled_r1",
                     bench.ARMS["ours_compiled"])
    assert "trainer.compile=true" in seen[0] and "+recipe=bench_gsm8k" in seen[0]
    assert (res["s_per_step"], res["first_step_s"], res["compile_s"]) == (13.0, 90.0, 37.0)


def test_round_ratios_pair_each_round_with_trls():
    by_arm = {"trl": [{"s_per_step": 50.0}, {"s_per_step": 40.0}],
              "ours": [{"s_per_step": 20.0}, {"s_per_step": 18.0}]}
    # round 1: 20 / 50 = 0.4; round 2: 18 / 40 = 0.45 (the median ratio of medians would be 19 / 45 = 0.42)
    assert bench.round_ratios(by_arm) == {"ours": pytest.approx([0.4, 0.45])}
    assert bench.round_ratios({"ours": by_arm["ours"]}) == {}


def test_main_prints_each_rounds_ratio(tmp_path, monkeypatch, capsys):
    """The whole summary path on fake arms: results.json holds the per-round ratios and the console says them."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_text("")
    (tmp_path / "trl_bench.py").write_text("")
    probe = {"shapes": bench.model_shapes(TOY), "prompt_tokens": 10, "decode_flops_s": 1e3, "training_flops_s": 2e3,
             "threads": 2}
    monkeypatch.setattr(bench, "floor_probe", lambda shape: probe)
    steps = {"trl": iter([50.0, 40.0]), "ours": iter([20.0, 18.0])}

    def arm(name, rss):
        return {"s_per_step": next(steps[name]), "rollout_s": None, "update_s": None, "peak_rss_gb": rss,
                "mean_length": 4, "engine": name}

    monkeypatch.setattr(bench, "trl", lambda a, shape, out, tag: arm("trl", 10.0))
    monkeypatch.setattr(bench, "ours", lambda a, shape, out, tag, extra: arm("ours", 4.0))
    monkeypatch.setattr("sys.argv", ["bench.py", "--shapes", "arithmetic", "--out", str(tmp_path / "out"),
                                     "--trl-venv", str(tmp_path / "venv"), "--model-dir", str(tmp_path / "model"),
                                     "--trl-script", str(tmp_path / "trl_bench.py")])
    bench.main()
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["ratios"]["arithmetic"]["s_per_step"]["ours"] == pytest.approx([0.4, 0.45])
    assert saved["ratios"]["arithmetic"]["peak_rss_gb"]["ours"] == pytest.approx([0.4, 0.4])
    assert "ours (default sampler) / TRL by round: s/step 0.40, 0.45; peak RSS 0.40, 0.40" in capsys.readouterr().out
