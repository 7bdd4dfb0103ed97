"""Shared fixtures: a tiny seeded random Llama + character tokenizer (no files, no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grpo_cli.cli import setup_process

# the tests run the library as the `grpo` command does: its process set up once (environment, warnings)
setup_process()
# sampler=auto (the default) samples with HF generate here, as the pinned numbers were measured, whether or not vLLM
# is installed; a test of the engine choice or of vLLM says so (sampler=vllm, or this variable removed)
os.environ.setdefault("GRPO_NO_VLLM", "1")

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): 2-layer random Llama over grpo_cli.policy.char_tokenizer."""
    from grpo_cli.policy import load_tiny_random

    model, tokenizer = load_tiny_random()
    model.eval()
    return model, tokenizer


@pytest.fixture()
def gsm8k_path() -> Path:
    if not GSM8K.exists():
        pytest.skip(f"GSM8K not found at {GSM8K} (it lives in ../shared/data beside the repo)")
    return GSM8K
