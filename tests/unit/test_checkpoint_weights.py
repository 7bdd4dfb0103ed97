"""A full-parameter checkpoint's weights (model.finetune=full): one safetensors file, or shards and an index above a
size, read back exactly, every shard verified when read."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli import checkpoint
from grpo_cli.errors import CheckpointError
from grpo_cli.policy import load_tiny_random


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_small_weights_are_one_file_and_read_back_exactly(tmp_path):
    model, _ = load_tiny_random()
    checkpoint.save_weights(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    read = checkpoint.read_weights(tmp_path)
    expected = _weights(model)
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in read)


def test_weights_above_the_shard_size_are_sharded_with_an_index(tmp_path):
    model, _ = load_tiny_random()
    # the tiny model: embeddings 100 x 32 fp32 = 12.8 KB, each decoder layer ~25 KB; 16 KB shards -> several files
    checkpoint.save_weights(model, tmp_path, shard_bytes=16_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((tmp_path / s).is_file() for s in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    read = checkpoint.read_weights(tmp_path)
    expected = _weights(model)
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in read)


@pytest.mark.parametrize("damage,expected", [
    (lambda f: f.unlink(), r"model-00002-of-\d+\.safetensors is missing"),
    (lambda f: f.write_bytes(f.read_bytes()[:40]), r"model-00002-of-\d+\.safetensors cannot be read"),
])
def test_a_damaged_shard_is_named_when_read(tmp_path, damage, expected):
    model, _ = load_tiny_random()
    checkpoint.save_weights(model, tmp_path, shard_bytes=16_000)
    damage(next(tmp_path.glob("model-00002-of-*.safetensors")))
    with pytest.raises(CheckpointError, match=expected):
        checkpoint.read_weights(tmp_path)


def test_weights_of_another_model_are_one_line(tmp_path):
    model, _ = load_tiny_random()
    checkpoint.save_weights(model, tmp_path)
    wider, _ = load_tiny_random(hidden_size=64)
    with pytest.raises(CheckpointError, match=r"do not fit this model .*model.embed_tokens.weight"):
        checkpoint.load_full_weights(wider, tmp_path)
