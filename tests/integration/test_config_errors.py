"""Settings a command refuses before any model loads, each in one `error:` line naming the fix, exit 2: lengths
past the model's context or the engine's, a reward model that is not there, bad eval and sample values."""

from __future__ import annotations

import shlex

import pytest

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from tests.helpers import REPO
from tests.helpers.cli import one_line_error, run_cli, stopped
from tests.helpers.engines import needs_vllm
from tests.helpers.runs import TINY


@pytest.mark.parametrize("overrides, line", [
    # item 2: vLLM would cut every completion at 64 tokens minus the prompt
    (["sampler.max_model_len=64", "sampler.max_new_tokens=4000"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (4000) exceed sampler.max_model_len (64 tokens): "
     "completions would be cut short; set sampler.max_prompt_tokens=32 and sampler.max_new_tokens=32"),
    # item 4: the engine holds fewer tokens than one prompt may have
    (["sampler.max_model_len=16", "sampler.max_new_tokens=8"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (8) exceed sampler.max_model_len (16 tokens): "
     "completions would be cut short; set sampler.max_prompt_tokens=8"),
    (["sampler.max_model_len=4096"],
     "sampler.max_model_len (4096) is longer than the model's context of 2048 tokens; "
     "set sampler.max_model_len=2048 or null"),
])
def test_vllm_lengths_are_checked_in_validation(monkeypatch, overrides, line):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["model=tiny", "sampler=vllm", *overrides]))
    assert str(err.value).splitlines() == [line]


@needs_vllm
def test_cli_vllm_max_model_len_too_short_stops_before_the_model_loads(tmp_path):
    out = run_cli(["train", *TINY, "sampler=vllm", "sampler.max_model_len=64", "sampler.max_new_tokens=4000",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert "exceed sampler.max_model_len (64 tokens)" in one_line_error(out)
    assert "run dir:" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command, overrides, line", [
    # the low item: 100000 new tokens cannot fit whatever the prompt; the fix names max_new_tokens
    ("train", ["sampler.max_new_tokens=100000"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (100000) exceed the model's context of 2048 "
     "tokens: completions would be cut short; set sampler.max_new_tokens=1024"),
    pytest.param("eval", ["eval.max_new_tokens=1500"],
                 "sampler.max_prompt_tokens (1024) + eval.max_new_tokens (1500) exceed the model's context of 2048 "
                 "tokens: completions would be cut short; set eval.max_new_tokens=1024 or "
                 "sampler.max_prompt_tokens=548"),
])
def test_hf_lengths_past_the_context_stop_before_the_model_loads(tmp_path, command, overrides, line):
    common = [*TINY, "trainer.max_steps=1"] if command == "train" else ["model=tiny"]
    out = run_cli([command, *common, *overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert one_line_error(out) == f"error: {line}"
    assert "run dir:" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides, says", [
    ([], "error: reward.name_or_path is required and has no value; set it on the command line: "
         "reward.name_or_path=..."),
    # a path that is not there: every completion went unscored (one warning), exit 0
    (["reward.name_or_path=/nonexistent/rm"], "error: reward.name_or_path ('/nonexistent/rm') is neither a folder "
                                               "that exists nor a hub id (ORG/MODEL)"),
])
def test_a_missing_reward_model_is_one_line_naming_reward_name_or_path(tmp_path, overrides, says):
    tiny = [o for o in TINY if not o.startswith("+reward")]  # the digit reward belongs to the rule rewards
    out = run_cli(["train", *tiny, "reward=orm", *overrides, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'r'}"])
    assert one_line_error(out).startswith(says)
    assert "run dir:" not in out.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command, override, key", [
    ("eval", "eval.limit=-1", "eval.limit"),
    ("eval", "eval.batch_size=0", "eval.batch_size"),
    ("eval", "eval.k=[0]", "eval.k"),
    ("eval", "eval.k=[]", "eval.k"),  # max([]) would be a traceback in the eval.k <= num_samples check
    ("eval", "eval.k=abc", "eval.k"),
    ("sample", "sample.n=0", "sample.n"),
    ("sample", "sample.num_prompts=0", "sample.num_prompts"),
])
def test_bad_values_stop_before_the_model_loads(command, override, key, no_model, tmp_path):
    extra = ["eval.num_samples=4"] if command == "eval" else []  # so that eval.k is read
    code, err = stopped(run_cli([command, override, *extra, f"hydra.run.dir={tmp_path}"]))
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {key} (") and f"; set {key}=" in err


def test_the_real_command_line(tmp_path):
    """The in-process runs above, once as a user runs them: every bad value at once, exit 2, no traceback."""
    out = run_cli(["eval", "eval.limit=-1", "eval.k=[]", "sampler.temperature=-1", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert sorted(line.split(" (")[0] for line in out.stderr.splitlines()) == [
        "error: eval.k", "error: eval.limit", "error: sampler.temperature"]


def test_sample_prompt_is_the_key_and_empty_is_an_error(tmp_path):
    code, err = stopped(run_cli(["sample", "model=tiny", "sample.prompt=", f"hydra.run.dir={tmp_path}"]))
    assert code == 2 and err.splitlines() == [
        "error: sample.prompt ('') is empty; give the question, sample.prompt=\"What is 17 + 25?\", or drop it to "
        "sample held-out problems"]
    assert not (tmp_path / "sample.jsonl").exists()


def test_readme_sample_line_composes():
    line = next(s for s in (REPO / "README.md").read_text().splitlines() if s.startswith("grpo sample "))
    # the shell takes the double quotes off: sample.prompt=What is 17 + 25?
    overrides = [a.replace('"', "") for a in shlex.split(line.split("#")[0])[2:]]
    cfg = compose("sample", [a for a in overrides if not a.startswith("checkpoint=")])
    assert cfg.sample.prompt == "What is 17 + 25?"
