"""`grpo rm` end to end on the tiny model: policy samples -> labels -> a reward model that reward=orm|prm loads,
iterations that continue with replay, and bad settings or inputs refused before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli import rm as T
from grpo_cli.commands import rm
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.rewards import answers_match, extract_answer
from tests.helpers.cli import run_cli
from tests.helpers.runs import EVAL_TINY, letters, write_jsonl

TINY = EVAL_TINY  # the rm tests' tiny settings


WIDE = {"COLUMNS": "200"}  # the console's lines unwrapped


@pytest.mark.parametrize("override,message", [
    ("rm.replay.share=1.5", r"rm.replay.share \(1.5\) must be in \[0, 1\]"),
    ("rm.replay.share=-0.1", r"rm.replay.share \(-0.1\) must be in \[0, 1\]"),
    ("rm.heldout_fraction=1", r"rm.heldout_fraction \(1\) must be in \[0, 1\)"),
    ("rm.epochs=0", r"rm.epochs \(0\) must be an integer >= 1"),
    ("rm.template='{completion}'", r"rm.template .* must hold \{prompt\} and \{completion\}"),
    ("labeler.k=0", r"labeler.k \(0\) must be an integer >= 1"),
    ("rm.balance=maybe", r"rm.balance \('maybe'\) must be true or false .*; set rm.balance=true"),
])
def test_bad_settings_stop_before_any_model_loads(tmp_path, override, message, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(rm, "load_inference", no_model)
    monkeypatch.setattr(rm, "starting_model", no_model)
    cfg = compose("rm", [*TINY, "labeler=mc", override])
    with pytest.raises(ConfigError, match=message):
        rm.run(cfg, tmp_path)


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path):
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "p", "completion": "abc"}])
    outside = write_jsonl(tmp_path / "outside.jsonl", [{"prompt": "p", "completion": "abc", "steps": [[9, 1]]}])
    for args, expected in ((["rm.replay.share=2"], "set rm.replay.share=0.1"),
                           ([f"rm.labeled={missing}"], "line 1: no label"),
                           ([f"rm.labeled={outside}"], "step end 9 is outside the completion (3 characters)")):
        out = run_cli(["rm", *TINY, *args, f"hydra.run.dir={tmp_path}/run"], env=WIDE)
        assert out.returncode == 2, out.stderr[-2000:]
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out.stderr


def fake_checkpoint(run_dir: Path) -> Path:
    """A grpo train checkpoint (written by checkpoint.save) of the tiny model whose LoRA weights are
    far from zero, without a training run."""
    from transformers import get_scheduler

    from grpo_cli import checkpoint
    from grpo_cli.policy import build_policy

    cfg = compose("train", TINY)
    policy, _, _ = build_policy(cfg.model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 2)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    scheduler = get_scheduler("constant", optimizer)
    state = {"step": 1, "history": [], "data": {"position": 0}}  # what a trainer_state holds (json_shapes.SHAPES)
    return checkpoint.save(run_dir, 1, policy, optimizer, scheduler, state, cfg)


def test_grpo_rm_end_to_end_from_policy_samples(tmp_path):
    """The CLI in a subprocess: base-model samples -> outcome labels -> ORM; then the saved model,
    loaded as reward=orm, gives the held-out numbers rm_eval.json reports."""
    run = tmp_path / "run"
    out = run_cli(["rm", *TINY, "rm.num_problems=8", "rm.samples_per_problem=3", "rm.epochs=1", "rm.lora.r=4",
                   "rm.lora.alpha=8", f"hydra.run.dir={run}"], env=WIDE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "grpo rm: outcome reward model" in out.stderr and "reward=orm reward.name_or_path=" in out.stderr
    assert "AUC in prompt (prompts)" in out.stderr  # the ranking GRPO uses, beside the pooled AUC
    report = json.loads((run / "rm_eval.json").read_text())
    labeled = [json.loads(line) for line in (run / "labeled.jsonl").read_text().splitlines()]
    # 8 problems x 3 samples; 0.2 x 8 = 1.6 -> 2 held-out prompts x 3 samples
    assert len(labeled) == 24 and report["rows"] == {"labeled": 24, "train_new": 18, "train_replay": 0,
                                                     "heldout": 6, "heldout_prompts": 2}
    assert all(r["label"] == float(answers_match(extract_answer(r["completion"]), r["answer"])) for r in labeled)
    assert (run / "model" / "model.safetensors").exists() and not list((run / "model").glob("*.bin"))
    cfg = compose("train", ["model=tiny", "reward=orm", f"reward.name_or_path={run / 'model'}", "reward.device=cpu"])
    heldout = [r for r in labeled if r["split"] == "heldout"]
    scores = build(cfg.reward)([r["prompt"] for r in heldout], [r["completion"] for r in heldout],
                               {"answer": [r["answer"] for r in heldout]}).rewards
    again = T.classification_metrics(scores, [r["label"] for r in heldout], [r["prompt"] for r in heldout])
    for key in ("labels", "positives", "accuracy", "loss", "mean_score"):
        assert again[key] == pytest.approx(report["heldout_after"][key], abs=1e-6), key
    # the tiny model is never right: no held-out prompt has both labels, so no within-prompt AUC
    assert (report["heldout_after"]["auc_within_prompt"], report["heldout_after"]["auc_prompts"]) == (None, 0) == \
        (again["auc_within_prompt"], again["auc_prompts"])


def test_grpo_rm_samples_from_a_checkpoint_and_labels_steps(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    cfg = compose("rm", [*TINY, f"checkpoint={ckpt}", "labeler=mc", "labeler.k=2", "rm.num_problems=4",
                         "rm.samples_per_problem=2", "rm.epochs=1", "sampler.max_new_tokens=8"])
    report = rm.run(cfg, tmp_path / "mc", [f"checkpoint={ckpt}"])
    assert report["kind"] == "process"
    rm.run(compose("rm", [*TINY, "labeler=mc", "labeler.k=2", "rm.num_problems=4", "rm.samples_per_problem=2",
                          "rm.epochs=1", "sampler.max_new_tokens=8"]), tmp_path / "base")
    texts = lambda run: [json.loads(line)["completion"] for line in (run / "labeled.jsonl").read_text().splitlines()]  # noqa: E731
    # same problems and seed, different weights: the checkpoint's adapter was on when sampling
    assert texts(tmp_path / "mc") != texts(tmp_path / "base")
    assert OmegaConf.load(tmp_path / "mc" / "model" / "config.json").architectures == ["LlamaForTokenClassification"]


def test_grpo_rm_iterations_continue_with_replay(tmp_path):
    """Two iterations on labeled files: the second continues from the first model and replays 10%."""
    replay = tmp_path / "replay"
    first = write_jsonl(tmp_path / "it0.jsonl", letters(20))
    second = write_jsonl(tmp_path / "it1.jsonl", [{**r, "prompt": "again " + r["prompt"]} for r in letters(50)])
    common = [*TINY, f"rm.replay.folder={replay}", "rm.epochs=1", "rm.lora.r=4", "rm.lora.alpha=8"]
    one = rm.run(compose("rm", [*common, f"rm.labeled={first}"]), tmp_path / "one")
    # 20 rows over 20 prompts: 4 held out, 16 trained; nothing earlier to replay
    assert one["rows"]["train_new"] == 16 and one["replay"]["iteration"] == 0 and one["replay"]["replay"] == 0
    two = rm.run(compose("rm", [*common, f"rm.labeled={second}", f"rm.init={tmp_path / 'one' / 'model'}"]),
                 tmp_path / "two")
    # 50 prompts: 10 held out, 40 new train rows -> 40 * 0.1 / 0.9 = 4.44 -> 4 replayed of iteration 0's 20
    assert two["replay"]["iteration"] == 1 and (two["rows"]["train_new"], two["rows"]["train_replay"]) == (40, 4)
    assert sorted(p.name for p in replay.iterdir()) == ["iteration_000.jsonl", "iteration_001.jsonl"]
    # the continued model starts where the first ended: run two's "before" is model one on run two's held-out rows
    heldout = [json.loads(line) for line in (tmp_path / "two" / "labeled.jsonl").read_text().splitlines()]
    heldout = [r for r in heldout if r["split"] == "heldout"]
    model, tokenizer = T.load_classifier(tmp_path / "one" / "model", "outcome", torch.device("cpu"), torch.float32)
    start = T.evaluate(model, tokenizer, heldout, kind="outcome", template="{prompt}{completion}")
    assert start == pytest.approx(two["heldout_before"])
