"""model.init_adapter: a training run that starts from a saved LoRA adapter (an SFT adapter, an earlier run) instead
of a fresh one, with that adapter as its reference when the loss reads one (β > 0)."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from grpo_cli.commands import train
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import TINY, metrics, tiny_cfg


def test_a_run_starts_from_a_saved_adapter_and_keeps_it_as_its_reference(tmp_path):
    # run A moves its adapter away from zero (LoRA B starts at 0) in 2 steps at TINY's lr 0.05, KL to the base read
    first = train.run(tiny_cfg("trainer.max_steps=2", "trainer.save_every=2", "algo.beta=0.04"), tmp_path / "a")
    trained = load_file(first / "adapter_model.safetensors")
    assert max(float(t.abs().max()) for k, t in trained.items() if "lora_B" in k) > 1e-3
    assert metrics(tmp_path / "a")[1]["kl"] > 1e-5  # its policy has left the base: the KL to it is measurable

    # run B starts from A's adapter and barely moves (lr 1e-9): its step-1 adapter is A's, not a fresh one
    second = train.run(tiny_cfg("trainer.max_steps=1", "trainer.save_every=1", "algo.beta=0.04", "optimizer.lr=1e-9",
                                f"model.init_adapter={first}"), tmp_path / "b")
    started = load_file(second / "adapter_model.safetensors")
    assert started.keys() == trained.keys()
    for key, tensor in trained.items():
        assert (started[key] - tensor).abs().max() < 1e-6, key
    # its reference is that adapter, not the base: at step 1 the policy is its reference, k3 KL exactly 0
    assert metrics(tmp_path / "b")[0]["kl"] == 0.0
    # the saved config names the adapter by its absolute path: the run resumes from any folder
    saved = (second / "config.yaml").read_text()
    assert f"init_adapter: {first}" in saved


def test_an_adapter_of_another_shape_stops_before_the_model_loads(tmp_path):
    folder = tmp_path / "sft"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")  # the check reads the config only
    lora = tiny_cfg().model.lora  # the tiny model's adapter (r 4) but for its rank
    (folder / "adapter_config.json").write_text(json.dumps(
        {"r": 2, "lora_alpha": lora.alpha, "target_modules": list(lora.target_modules)}))
    out = run_cli(["train", *TINY, "trainer.max_steps=1", f"model.init_adapter={folder}",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    # r differs: the weights would not fit; alpha would fit and silently scale them otherwise, so it is checked too
    assert one_line_error(out) == (f"error: model.init_adapter ({folder}) was trained with r=2, model.lora.r is 4; "
                                   f"set model.lora.r=2")
    assert "run dir:" not in out.stderr


def test_a_folder_without_an_adapter_is_refused(tmp_path):
    out = run_cli(["train", *TINY, "trainer.max_steps=1", f"model.init_adapter={tmp_path}",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert one_line_error(out) == (f"error: model.init_adapter ({tmp_path}) holds no adapter_model.safetensors or "
                                   f"adapter_config.json; pass a checkpoint folder (RUN/checkpoints/step_N) or a "
                                   f"peft adapter folder")
