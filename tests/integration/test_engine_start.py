"""vLLM's engine start: settings it cannot start with are an error naming the setting, a model it cannot serve
falls back to HF generate and the run's config records it, a prompt it refuses at run time is one line, and a
vLLM run resumed where vLLM is missing names the install."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from grpo_cli.commands import train
from grpo_cli.config import compose
from grpo_cli.errors import ConfigError, DataError
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.engines import needs_vllm
from tests.helpers.runs import copy_run, digests, metrics, sampler_settings, tiny_cfg


class FakeVLLM:
    """vLLM's module as `import_vllm` returns it, with an `LLM` that fails as `error` says."""

    def __init__(self, error: Exception):
        self.error = error

    def LLM(self, **kwargs):  # noqa: N802 (vLLM's name)
        raise self.error


def test_a_fallback_to_hf_generate_is_recorded_in_the_runs_config(tmp_path, monkeypatch, capsys):
    from grpo_cli import checkpoint
    from grpo_cli.rollout import vllm_engine as engine

    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setattr(engine, "import_vllm", lambda: FakeVLLM(ValueError("Model architectures ['X'] are not "
                                                                           "supported for now.")))
    train.run(tiny_cfg("sampler=vllm", "sampler.max_new_tokens=8", "trainer.max_steps=1"), tmp_path)
    assert capsys.readouterr().err.count("vLLM cannot serve this model") == 1
    saved = checkpoint.load_config(checkpoint.resolve(tmp_path)).sampler
    assert saved._target_ == "grpo_cli.rollout.hf.HFSampler" and saved.max_new_tokens == 8 and "dtype" not in saved
    # the resume samples as the run did, with HF generate: no engine is tried again
    monkeypatch.setattr(engine, "import_vllm", lambda: pytest.fail("the resume tried vLLM again"))
    train.run(tiny_cfg("trainer.max_steps=2", f"resume={tmp_path}"), tmp_path)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_a_kv_cache_too_small_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    from grpo_cli.rollout import vllm_engine as engine

    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setattr(engine, "import_vllm", lambda: FakeVLLM(ValueError(
        "To serve at least one request with the model's max seq len (2048), (0.02 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (0.0 GiB). Try increasing `gpu_memory_utilization` ...")))
    with pytest.raises(ConfigError) as err:
        train.run(tiny_cfg("sampler=vllm", "sampler.cpu_kv_cache_gb=0.0001", "trainer.max_steps=1"), tmp_path)
    assert str(err.value).splitlines() == [
        "sampler=vllm cannot start with sampler.cpu_kv_cache_gb=0.0001: To serve at least one request with the "
        "model's max seq len (2048), (0.02 GiB KV cache is needed, which is larger than the available KV cache "
        "memory (0.0 GiB); raise sampler.cpu_kv_cache_gb, or set a shorter sampler.max_model_len (now 1032: "
        "sampler.max_prompt_tokens 1024 + max_new_tokens 8)"]
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_vllm
@pytest.mark.slow  # loads the embedded model into vLLM (~13 s); the stand-in test above runs in the fast suite
def test_cli_kv_cache_too_small_on_the_embedded_model_is_one_line(tmp_path):
    out = run_cli(["train", "sampler=vllm", "sampler.cpu_kv_cache_gb=0.0001", "sampler.max_new_tokens=8",
                   "trainer.max_steps=1", "trainer.report_to=[]", f"hydra.run.dir={tmp_path / 'run'}"])
    line = one_line_error(out)
    assert line.startswith("error: sampler=vllm cannot start with sampler.cpu_kv_cache_gb=0.0001: ")
    assert "HF generate" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@needs_vllm
def test_a_prompt_the_engine_refuses_at_run_time_is_one_line(tiny):
    from vllm.exceptions import VLLMValidationError

    from grpo_cli.rollout.vllm import VLLMSampler

    class Refuses:  # a started engine whose input check refuses the prompt, as vLLM's does
        def apply_model(self, fn):  # the weight push before each generate: nothing to load into
            pass

        def reset_prefix_cache(self):
            pass

        def generate(self, *args, **kwargs):
            raise VLLMValidationError("The decoder prompt (length 40) is longer than the maximum model length "
                                      "of 16. Make sure that `max_model_len` is no smaller than the number of "
                                      "text tokens.")

    model, tokenizer = tiny
    sampler = VLLMSampler(**sampler_settings("vllm", max_new_tokens=4, max_model_len=16))
    sampler.llm = Refuses()
    with pytest.raises(DataError) as err:
        sampler.generate(model, tokenizer, ["<|im_start|>user\nwhat is 1 + 1?<|im_end|>\n"], 1, greedy=True)
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith("a prompt does not fit the engine (The decoder prompt (length 40) is longer")
    assert str(err.value).endswith("raise sampler.max_model_len (now 16) or lower sampler.max_prompt_tokens (1024)")


def test_resuming_a_vllm_run_without_vllm_names_the_install_not_sampler_default(trained_run, tmp_path, monkeypatch):
    from grpo_cli import checkpoint
    from grpo_cli.rollout import vllm_engine as engine

    run = copy_run(trained_run, tmp_path / "run")
    for ckpt in checkpoint.list_checkpoints(run):  # as a run sampled by vLLM saves it
        saved = checkpoint.load_config(ckpt)
        saved.sampler = compose("train", ["sampler=vllm", "sampler.max_new_tokens=8"]).sampler
        (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    before = digests(run)
    monkeypatch.setattr(engine, "installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        train.run(tiny_cfg("trainer.max_steps=3", f"resume={run}"), run, overrides=[f"resume={run}"])
    assert str(err.value).splitlines() == [
        f"this run samples with vLLM (sampler=vllm, in its saved config), which is not installed here: "
        f"{engine.INSTALL}; a resumed run keeps its own sampler"]
    assert digests(run) == before
