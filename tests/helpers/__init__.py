"""What several test files share, one module a subject; conftest.py re-exports the fixtures, and test files import
from these modules (never from each other):

- runs: the tiny training job's settings, samplers' settings from the YAML, readers and copies of a run's files,
  labeled rows and JSONL files;
- cli: `run_cli` (a command in this process, as the console script runs it), its one-line-error readers, a command
  in a child process, and the suite's YAML parse cache;
- ranks: 2 gloo ranks from a fork server (`two_ranks`, `gloo_rank`) and `torchrun`;
- batches: the fixed batch of the 2-rank update tests and the importance-sampling batch of the loss tests;
- engines: vLLM beside HF generate (whether vLLM is installed, prompts, a random adapter, HF's greedy answers);
- tools: users' tool and reward files, and the scripted first turn that calls a tool (`first_turn_calls`);
- judge: loopback HTTP servers (`LocalServer`, `JudgeServer`) and their JSON replies.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
