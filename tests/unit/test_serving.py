"""`grpo serve`'s command line (grpo_cli/serving.py): vLLM's server with the run's model, LoRA rank, dtype and
lengths, the flags the client relies on, and one line for a model it cannot serve."""

from __future__ import annotations

import os
import sys

import pytest

from grpo_cli.config import compose
from grpo_cli.errors import ConfigError
from grpo_cli.serving import command, shell_line, usable_cores
from tests.helpers.cli import run_cli


def flags(argv: list[str]) -> dict[str, str | None]:
    """{--flag: its value, or None for a switch}."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_a_lora_run_gets_its_rank_lengths_and_raw_logprobs(tmp_path):
    cfg = compose("serve", ["model=hf", f"model.name_or_path={tmp_path}", "model.name=mine", "model.lora.r=12",
                            "sampler.url=http://0.0.0.0:8123", "sampler.max_new_tokens=100",
                            "sampler.max_prompt_tokens=300", "model.device=cpu"])
    argv, env = command(cfg)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    f = flags(argv)
    assert f["--model"] == str(tmp_path) and f["--served-model-name"] == "mine"
    assert (f["--host"], f["--port"]) == ("0.0.0.0", "8123")
    assert f["--max-lora-rank"] == "16"  # vLLM's next allowed rank above 12
    assert "--enable-lora" in f and f["--logprobs-mode"] == "raw_logprobs" and f["--generation-config"] == "vllm"
    assert f["--max-model-len"] == "400" and f["--dtype"] == "float32"  # 300 + 100; auto on a CPU
    assert "--no-enable-chunked-prefill" in f and f["--kv-cache-memory-bytes"] == str(2 * 2**30)
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(usable_cores())}


def test_a_full_parameter_run_gets_the_reload_endpoints_and_no_lora(tmp_path):
    cfg = compose("serve", ["model=hf", f"model.name_or_path={tmp_path}", "model.finetune=full", "model.device=cpu"])
    argv, env = command(cfg)
    assert "--enable-lora" not in argv and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE=1" in shell_line(argv, env)


def test_a_model_built_in_memory_cannot_be_served():
    with pytest.raises(ConfigError, match=r"^grpo serve needs a model with files, and model.loader "
                                          r"\(grpo_cli.policy.load_tiny_random\) builds one in memory; use model=hf"):
        command(compose("serve", ["model=tiny"]))


def test_grpo_serve_print_prints_the_command_line_and_starts_nothing(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    out = run_cli(["serve", "--print", "model=hf", f"model.name_or_path={tmp_path}", "model.device=cpu"], cwd=here)
    assert out.returncode == 0, out.stderr
    assert list(here.iterdir()) == []  # no log file, no run folder where it was started
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ") and "vllm.entrypoints.openai.api_server" in line
    assert f"--model {tmp_path}" in line
