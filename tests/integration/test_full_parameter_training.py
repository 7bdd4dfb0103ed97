"""model.finetune=full on the tiny model: every weight trains, the reference is a frozen copy of the initial
weights (none when β = 0), checkpoints hold the full weights and resume exactly, export and eval read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint
from grpo_cli.commands import export, train
from grpo_cli.config import compose
from grpo_cli.policy import build_policy, load_tiny_random
from tests.helpers.cli import run_cli, stopped
from tests.helpers.runs import EVAL_TINY, TINY, copy_run, deterministic, metrics, tiny_cfg

FULL = ["model.finetune=full", "optimizer.lr=0.01"]


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, str]:
    """(folder, console) of a 2-step full-parameter tiny run, a checkpoint at each step, made through the command."""
    folder = tmp_path_factory.mktemp("full") / "run"
    code, _, err = run_cli(["train", *TINY, *FULL, "trainer.max_steps=2", "trainer.save_every=1",
                            f"hydra.run.dir={folder}"])
    assert code == 0, err[-2000:]
    return folder, err


@pytest.fixture()
def full_run(full) -> Path:
    return full[0]


def test_every_weight_trains_and_the_checkpoint_holds_them_all(full_run):
    last = full_run / "checkpoints" / "step_000002"
    assert not (last / "adapter_model.safetensors").exists()
    weights = load_file(last / "model.safetensors")
    base, _ = load_tiny_random()
    names = dict(base.named_parameters())
    assert weights.keys() == names.keys()  # every weight, the tied head once (as the embeddings)
    moved = [k for k in weights if not torch.equal(weights[k], names[k].detach())]
    assert len(moved) == len(weights), sorted(set(weights) - set(moved))
    assert metrics(full_run)[0]["counts/ref_forward_seqs"] == 8  # β > 0: the frozen copy ran once per row


def test_resume_of_a_full_run_is_exact(full_run, tmp_path):
    # the split run: a copy of the finished 2-step run, resumed to 4 steps
    straight, split = tmp_path / "straight", copy_run(full_run, tmp_path / "split")
    train.run(tiny_cfg(*FULL, "trainer.max_steps=4", "trainer.save_every=2"), straight)
    train.run(tiny_cfg(*FULL, "trainer.max_steps=4", "trainer.save_every=1", f"resume={split}"), split)

    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]  # losses, KL, grad norms: bit for bit
    wa = load_file(straight / "checkpoints/step_000004/model.safetensors")
    wb = load_file(split / "checkpoints/step_000004/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_beta_zero_keeps_no_reference_copy(tmp_path):
    code, out, err = run_cli(["train", *TINY, *FULL, "algo.beta=0", "trainer.max_steps=1",
                              f"hydra.run.dir={tmp_path / 'b0'}"])
    assert code == 0, err[-2000:]
    assert "reference: none (algo.beta=0)" in err
    assert metrics(tmp_path / "b0")[0]["counts/ref_forward_seqs"] == 0


def test_beta_above_zero_says_the_reference_is_a_frozen_copy(full):
    _, err = full
    assert "reference: a frozen copy of the initial weights" in err


@pytest.mark.parametrize("override,expected", [
    ("model.quantization=4bit", "model.finetune (full) cannot train a 4-bit base"),
    ("iterative.iterations=2", "model.finetune (full) does not support iterative RL yet"),
    ("model.dtype=bfloat16", "model.finetune (full) trains its weights in model.dtype (bfloat16)"),
])
def test_full_refuses_what_it_cannot_do_in_one_line(override, expected, tmp_path):
    code, err = stopped(run_cli(["train", *TINY, *FULL, override, f"hydra.run.dir={tmp_path}"]))
    # validate reports every problem at once (4bit without bitsandbytes, iterative's own settings): ours is one line
    assert code == 2 and [line for line in err.splitlines() if expected in line][0].startswith("error:")


def test_export_of_a_full_run_loads_with_plain_transformers(full_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = export.run(compose("export", [f"checkpoint={full_run}", f"output={tmp_path / 'out'}",
                                        "export.dtype=float32"]))
    assert not (out / "adapter_config.json").exists() and (out / "config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    policy, tokenizer, _ = build_policy(checkpoint.load_config(full_run / "checkpoints/step_000002").model)
    checkpoint.load_weights(policy, full_run / "checkpoints/step_000002")
    ids = torch.tensor([tokenizer("What is 2+3? 5").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-6)
        base, _ = load_tiny_random()
        assert (base(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() > 1e-3  # it trained
    assert json.loads((out / "export.json").read_text())["finetune"] == "full"


def test_eval_reads_a_full_run(full_run, tmp_path):
    # no model= override: eval builds the run's own model section (model.finetune=full with it)
    args = [a for a in EVAL_TINY if not a.startswith("model=")]
    code, out, err = run_cli(["eval", f"checkpoint={full_run}", *args, "eval.limit=4", "eval.include_base=true",
                              f"hydra.run.dir={tmp_path}"])
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert {r["checkpoint"] for r in rows} == {None, str(full_run / "checkpoints" / "step_000001"),
                                               str(full_run / "checkpoints" / "step_000002")}
