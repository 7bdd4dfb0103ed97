"""`grpo export`: the exported folder computes what the checkpoint's policy computes, merged or not,
loads with plain transformers / peft, and never overwrites a folder it was not told to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint
from grpo_cli.commands import export
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from grpo_cli.policy import build_policy, load_tiny_random
from tests.helpers.cli import run_cli

# the digit reward gives the tiny model's random text mixed rewards in a group, so the adapter moves
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tiny_run(trained_run) -> Path:
    """The session's 2-step tiny run (conftest's trained_run): its step-2 adapter has moved away from zero."""
    last = trained_run / "checkpoints" / "step_000002"
    assert any(v.abs().sum() > 0 for k, v in load_file(last / "adapter_model.safetensors").items() if "lora_B" in k)
    return trained_run


def export_cfg(ckpt, out, *overrides: str):
    return compose("export", [f"checkpoint={ckpt}", f"output={out}", *overrides])


def policy_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint's policy as train/eval/sample use it: base + unmerged LoRA."""
    policy, _, _ = build_policy(checkpoint.load_config(ckpt).model)
    checkpoint.load_adapter(policy, ckpt)
    policy.eval()
    with torch.no_grad():
        return policy(input_ids=ids).logits


def prompt_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer(text + "5", add_special_tokens=False).input_ids])


def test_merged_export_has_the_checkpoint_logits_and_loads_with_plain_transformers(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export.run(export_cfg(tiny_run, tmp_path / "merged", "export.dtype=float32"))
    ckpt = checkpoint.resolve(tiny_run)
    assert not (out / "adapter_config.json").exists()  # else transformers would load it as a peft adapter
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32
    assert not any("lora" in k for k in model.state_dict())
    # the in-memory character tokenizer and its ChatML template were saved with the weights
    _, reference_tok = load_tiny_random()
    assert (tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
            == reference_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False))
    ids = prompt_ids(tokenizer)
    assert torch.equal(ids, prompt_ids(reference_tok))
    with torch.no_grad():
        exported = model(input_ids=ids).logits
    expected = policy_logits(ckpt, ids)
    torch.testing.assert_close(exported, expected, rtol=0, atol=1e-5)
    # ... and the merge did change the model: the base alone gives other logits
    base, _ = load_tiny_random()
    with torch.no_grad():
        assert (base(input_ids=ids).logits - expected).abs().max() > 1e-3

    # sampling settings: only the special-token ids, nothing that changes how a server samples
    gen = json.loads((out / "generation_config.json").read_text())
    assert {k for k in gen if not k.startswith("_") and k != "transformers_version"} <= {
        "bos_token_id", "eos_token_id", "pad_token_id"}
    assert gen["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 2 and record["merged"] and record["base_model"]["name"] == "tiny-random-llama"


def test_adapter_export_reloads_through_peft_to_the_same_logits(tiny_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    out = export.run(export_cfg(tiny_run, tmp_path / "adapter", "export.merge=false", "export.dtype=float32"))
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "export.json"} <= {
        p.name for p in out.iterdir()}
    assert not (out / "model.safetensors").exists()  # only the adapter, not a copy of the base
    # the tiny base is built in memory: there is no folder to name, the caller brings the base
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    base, _ = load_tiny_random()
    model = PeftModel.from_pretrained(base, out).eval()
    ids = prompt_ids(AutoTokenizer.from_pretrained(out))
    with torch.no_grad():
        reloaded = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded, policy_logits(checkpoint.resolve(tiny_run), ids), rtol=0, atol=1e-5)


def test_default_dtype_is_the_one_the_policy_trained_in(tiny_run, tmp_path):
    # issue #23, item 3: an fp32 CPU run exported with the defaults has its own logits, not bf16's
    ckpt = checkpoint.resolve(tiny_run)
    assert json.loads((ckpt / "trainer_state.json").read_text())["dtype"] == "float32"
    out = export.run(export_cfg(tiny_run, tmp_path / "auto"))
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}
    assert json.loads((out / "export.json").read_text())["dtype"] == "float32"
    from transformers import AutoModelForCausalLM

    _, tokenizer = load_tiny_random()
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    torch.testing.assert_close(logits, policy_logits(ckpt, ids), rtol=0, atol=1e-5)


def test_default_dtype_of_a_checkpoint_without_the_record(tiny_run, tmp_path):
    import shutil

    ckpt = shutil.copytree(checkpoint.resolve(tiny_run), tmp_path / "old" / "step_000002")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["dtype"]  # written before the record existed: model.dtype (float32 for model=tiny) decides
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    out = export.run(export_cfg(ckpt, tmp_path / "auto"))
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}


def test_dtype_casts_the_written_weights(tiny_run, tmp_path):
    out = export.run(export_cfg(tiny_run, tmp_path / "bf16", "export.dtype=bfloat16"))
    weights = load_file(out / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    adapter = export.run(export_cfg(tiny_run, tmp_path / "fp16", "export.merge=false", "export.dtype=float16"))
    assert {v.dtype for v in load_file(adapter / "adapter_model.safetensors").values()} == {torch.float16}


def test_refuses_a_non_empty_folder_before_loading_anything(tiny_run, tmp_path, monkeypatch):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(export, "build_policy", lambda *_: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=r"is not empty; .*set export.overwrite=true"):
        export.run(export_cfg(tiny_run, out))
    with pytest.raises(ConfigError, match=r"export.dtype \('fp8'\) must be auto or one of bfloat16, float16, "):
        export.run(export_cfg(tiny_run, tmp_path / "new", "export.dtype=fp8"))
    with pytest.raises(ConfigError, match=r"holds the checkpoint"):
        export.run(export_cfg(tiny_run, tiny_run, "export.overwrite=true"))
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_the_whole_folder(tiny_run, tmp_path):
    out = export.run(export_cfg(tiny_run, tmp_path / "o", "export.merge=false"))
    export.run(export_cfg(tiny_run, out, "export.overwrite=true"))
    # the adapter files of the first export are gone: a stale adapter_config.json would make
    # transformers load the folder as a peft adapter
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
    assert not list(tmp_path.glob("o.tmp*"))


def test_cli_missing_output_and_non_empty_folder_exit_2_with_one_line(tiny_run, tmp_path):
    def grpo(*args):
        return run_cli(["export", *args, f"hydra.run.dir={tmp_path}/h"])

    missing = grpo(f"checkpoint={tiny_run}")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: output is required; pass the folder to write: output=DIR"]
    both = grpo()
    assert both.returncode == 2 and [line.split(";")[0] for line in both.stderr.strip().splitlines()] == [
        "error: checkpoint is required", "error: output is required"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    taken = grpo(f"checkpoint={tiny_run}", f"output={tmp_path}/full")
    assert taken.returncode == 2 and len(taken.stderr.strip().splitlines()) == 1
    assert "export.overwrite=true" in taken.stderr


@pytest.mark.slow
@pytest.mark.ci
def test_embedded_smollm2_export_merged_and_adapter(tmp_path):
    """The embedded SmolLM2-135M with a random LoRA (B != 0): merged fp32 and adapter exports reload
    to the policy's logits, the adapter through the base folder its config names."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    cfg = compose("train", ["model.device=cpu", "model.lora.r=4",
                            "model.lora.target_modules=[q_proj,v_proj,down_proj]"])
    # LoRA A is drawn from torch's global generator when the policy is built: seeded here, so the adapter (and the
    # rounding the merge is held to) is the same whichever tests ran before in this process
    torch.manual_seed(0)
    policy, tokenizer, _ = build_policy(cfg.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # LoRA B starts at zero: without this the merge would change nothing
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    state = {"step": 1, "history": [], "data": {"position": 0}}  # what a trainer_state holds (json_shapes.SHAPES)
    ckpt = checkpoint.save(tmp_path / "run", 1, policy, optimizer, scheduler, state, cfg)

    ids = prompt_ids(tokenizer)
    policy.eval()
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        with policy.disable_adapter():
            assert (policy(input_ids=ids).logits - expected).abs().max() > 1e-2  # the adapter matters
        exact = policy.double()(input_ids=ids).logits  # float64: the reference both fp32 paths round
    del policy

    merged = export.run(export_cfg(ckpt, tmp_path / "merged", "export.dtype=float32"))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    # (W + s·BA)x and Wx + s·B(Ax) round differently, and 30 fp32 layers amplify it: on logits up
    # to ~39 the unmerged policy itself is ~1e-4 from float64 (measured 7e-5..1e-4), so 1e-5 between
    # the two fp32 paths cannot hold here (it does on the 2-layer tiny model). Asked instead: the
    # merged model is as close to the exact logits as the policy is, and within 2.5e-4 of it.
    policy_error = (expected.double() - exact).abs().max()
    assert (logits.double() - exact).abs().max() <= 1.5 * policy_error
    torch.testing.assert_close(logits, expected, rtol=0, atol=2.5e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))

    adapter = export.run(export_cfg(ckpt, tmp_path / "adapter", "export.merge=false", "export.dtype=float32"))
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base_dir).is_absolute() and (Path(base_dir) / "model.safetensors").exists()  # the cached base
    with torch.no_grad():
        logits = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
