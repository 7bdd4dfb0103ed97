"""sampler=vllm_server with trainer.fsdp=true on 2 gloo ranks, against the stand-in server (tests/fake_vllm.py) that
the test process runs: the model check's forward is one every rank joins; a full-parameter policy's weights are
gathered a layer at a time and written by rank 0 as one safetensors file per part (HF's sharded layout), equal to
the policy gathered whole; a LoRA policy's adapter is written from rank 0's own copy, and no rank's sharded base is
touched by the push (every rank holds it as the others do). The torchrun runs: tests/integration/test_server_ranks.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from grpo_cli import fsdp
from grpo_cli.distributed import close_world, init_world
from grpo_cli.policy import build_policy, load_tiny_random
from grpo_cli.rollout.vllm_server import VLLMServerSampler
from tests.fake_vllm import FakeVLLM
from tests.helpers.engines import set_adapter
from tests.helpers.ranks import two_ranks
from tests.helpers.runs import sampler_settings, tiny_cfg


def _worker(rank: int, size: int, init_method: str, out: str) -> None:
    host, port = init_method.removeprefix("tcp://").split(":")  # torchrun's environment: init_world joins as a run
    os.environ.update(WORLD_SIZE=str(size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR=host, MASTER_PORT=port)
    torch.set_num_threads(1)
    world = init_world()
    try:
        url = Path(out, "url").read_text()
        _full(world, url, Path(out))
        torch.distributed.barrier()  # the server's requests of the two cases apart
        _lora(world, url, Path(out))
    finally:
        close_world()


def _sampler(url: str, out: Path) -> VLLMServerSampler:
    return VLLMServerSampler(**sampler_settings("vllm_server", url=url, adapter_dir=str(out / "pushed")))


def _held_sharded(policy, world) -> list[list[bool]]:
    """Every rank's list of which of its policy's weights it holds as shards now (FSDP's gathered-or-not state)."""
    return world.gather([isinstance(p, DTensor) for p in policy.parameters()])


def _full(world, url: str, out: Path) -> None:
    """Start (the model check, the first push), a sync with nothing changed, a sampling call inside `fsdp.whole`
    (every weight gathered: nothing changed either), then one weight changed on rank 1's shard only and a sync."""
    policy, tokenizer, _ = build_policy(tiny_cfg("model.finetune=full").model)
    fsdp.shard(policy, world)
    sampler = _sampler(url, out)
    sampler.start(policy, None)
    sampler.sync(policy)  # the same weights: nothing pushed
    with fsdp.whole(policy):  # gathered for sampling, as recipe._explore does: the same weights, nothing pushed
        sampler.generate(policy, tokenizer, ["ab"], 2, greedy=True)
    held = _held_sharded(policy, world)
    with torch.no_grad():  # an update that moved one weight of rank 1's shard only: every rank must see the change
        p = dict(policy.named_parameters())["model.layers.1.mlp.down_proj.weight"]
        if world.rank == 1:
            fsdp.local(p)[0, 0] += 0.5
    sampler.sync(policy)
    whole = {name: fsdp.whole_tensor(p.detach()) for name, p in policy.named_parameters()}  # every rank joins
    if world.main:
        save_file({k: v.contiguous() for k, v in whole.items()}, out / "full_whole.safetensors")
        (out / "full.json").write_text(json.dumps({"held": held, "last_push": sampler.last_push}))


def _lora(world, url: str, out: Path) -> None:
    """Start and one adapter change: rank 0 writes the adapter it holds whole; the base stays as every rank has it."""
    policy, _, _ = build_policy(tiny_cfg().model)
    fsdp.shard(policy, world)
    sampler = _sampler(url, out)
    sampler.start(policy, None)
    held = [_held_sharded(policy, world)]
    set_adapter(policy, seed=1)  # the same on every rank, as after an update
    sampler.sync(policy)
    held.append(_held_sharded(policy, world))
    if world.main:
        lora = {n: p.detach() for n, p in policy.named_parameters() if "lora_" in n}
        save_file(lora, out / "lora_own.safetensors")
        (out / "lora.json").write_text(json.dumps({"held": held, "serving": sampler.serving}))


@pytest.mark.slow  # 2 FSDP rank processes (~13 s): make test-ci
@pytest.mark.ci
def test_fsdp_ranks_push_to_one_server_from_rank_0(tmp_path):
    scorer, tokenizer, _ = build_policy(tiny_cfg().model)  # the ranks' base: the same seeded tiny model
    initial = {n: p.detach() for n, p in load_tiny_random()[0].named_parameters()}  # model=tiny; a tied weight once
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id) as server:
        (tmp_path / "url").write_text(server.base)
        two_ranks(_worker, tmp_path)

    # full: two pushes (start; the changed weight), none for the unchanged sync or the sampling call in `whole`
    full = json.loads((tmp_path / "full.json").read_text())
    assert len(server.reloaded) == 2, [files for files, _ in server.reloaded]
    for files, _ in server.reloaded:  # one file per part: the embeddings, each of the 2 layers, the final norm
        assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)], files
    first, second = (weights for _, weights in server.reloaded)
    # every weight under its HF name, and the tied LM head under its own too (the embeddings: vLLM's CPU build
    # refreshes its head's packed copy from that name only)
    assert first.keys() == {*initial, "lm_head.weight"}
    assert all(torch.equal(first[k], initial[k]) for k in initial)  # the model as it started
    assert torch.equal(first["lm_head.weight"], initial["model.embed_tokens.weight"])
    whole = load_file(tmp_path / "full_whole.safetensors")
    assert second.keys() == {*whole, "lm_head.weight"} and all(torch.equal(second[k], whole[k]) for k in whole)
    changed = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(second[changed], first[changed])  # rank 1's shard moved: the push saw it
    head = whole["model.embed_tokens.weight"].numel() * 4
    assert full["last_push"]["bytes"] == sum(v.numel() * 4 for v in whole.values()) + head
    assert full["last_push"]["gap"] < 1e-5  # the check after the push: the server answers as the gathered policy
    # the weights each rank holds as shards (gathered or not) are the same on both: FSDP's gathers pair up
    assert full["held"][0] == full["held"][1]

    # the model check at each start asks the server once, from rank 0 (two ranks asking at once crash vLLM 0.32's
    # CPU build with LoRA on: its LoRA logits path sizes its indices by request, not by prompt token); the full
    # case's two pushes each add one check of their own
    probes = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is not None]
    assert len(probes) == 2 + 2, len(probes)

    # LoRA: rank 0 loads each version once; the base is held on every rank as on the others, after each push
    lora = json.loads((tmp_path / "lora.json").read_text())
    loads = [b for p, b in server.requests if p == "/v1/load_lora_adapter"]
    assert [b["lora_name"] for b in loads][-1] == lora["serving"] and len(loads) == 2
    for held in lora["held"]:
        assert held[0] == held[1]
    saved = load_file(Path(loads[-1]["lora_path"]) / "adapter_model.safetensors")
    own = load_file(tmp_path / "lora_own.safetensors")
    assert saved and len(saved) == len(own)  # A and B of each adapted layer
    for key, value in saved.items():  # peft's file layout: the adapter's name taken out of the key
        assert torch.equal(value, own[key.replace(".weight", ".default.weight")]), key
