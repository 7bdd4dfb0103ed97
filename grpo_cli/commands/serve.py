"""`grpo serve`: start vLLM's server for a run's model, the one `sampler=vllm_server` samples from.

    grpo serve                                              # the embedded SmolLM2, LoRA rank 16, http://127.0.0.1:8000
    grpo serve model=hf model.name_or_path=DIR model.lora.r=32 sampler.url=http://0.0.0.0:8100
    grpo serve --print                                      # vLLM's own command line, to run elsewhere

The server is vLLM's own (grpo_cli/serving.py says which flags it gets and why); this command only builds its
command line from the same config groups as `grpo train`, so the model, LoRA rank, dtype and lengths match.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from grpo_cli.app import hydra_app
from grpo_cli.config import validate
from grpo_cli.metrics.console import console
from grpo_cli.rollout import vllm_engine
from grpo_cli.serving import command, shell_line, start


@hydra_app("serve")
def main(cfg: DictConfig) -> None:
    validate(cfg)
    argv, env = command(cfg)
    line = shell_line(argv, env)
    if cfg.serve.print:
        print(line)
        return
    vllm_engine.import_checked()  # the install command, not a traceback from the launcher
    console.print(f"serve: {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"serve: {cfg.model.name} at {cfg.sampler.url} once vLLM has started (Ctrl-C stops it); train "
                  f"with sampler=vllm_server sampler.url={cfg.sampler.url}", markup=False, highlight=False,
                  soft_wrap=True)
    start(argv, env, verbose=os.environ.get("GRPO_VERBOSE") == "1")
