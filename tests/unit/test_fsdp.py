"""trainer.fsdp (grpo_cli.fsdp) on 2 gloo ranks: the base sharded, the same update as one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import fsdp
from grpo_cli.distributed import SINGLE, World
from tests.helpers.batches import ROWS, _name, _policy, _save_step, _step
from tests.helpers.ranks import gloo_rank, group_threads, two_ranks

# a subset of test_distributed's cases: plain, μ = 2 (old log-probs), β > 0 (the reference forward, adapter off),
# a rank with no active row (it runs its spare rows, masked out), the top-entropy mask (one more forward)
CASES = [("grpo", 0.0, 2, "batch", "mixed"), ("dapo", 0.04, 1, "group", "mixed"),
         ("grpo", 0.0, 1, "group", "dead_rank"), ("dr_grpo", 0.0, 2, "batch", "dead_rank"),
         ("dapo", 0.04, 2, "group", "entropy")]


def _worker(rank: int, size: int, init_method: str, out: str) -> None:
    with gloo_rank(rank, size, init_method) as world:
        _memory(world, out)
        for case in CASES:
            _save_step(out, case, rank, *_step(case, world, fsdp=True))
    # the threads still running once the group is gone: gloo's and the store's left to the interpreter's exit can
    # abort this rank after its work is done
    Path(out, f"threads_r{rank}.json").write_text(json.dumps(group_threads()))


def _memory(world: World, out: str) -> None:
    """What this rank holds of a sharded policy (the policy goes with the call, as a run's does with the run)."""
    policy, _ = _policy()
    line = fsdp.shard(policy, world)
    held, whole = fsdp.resident_bytes(policy)
    Path(out, f"memory_r{world.rank}.json").write_text(json.dumps({"line": line, "held": held, "whole": whole}))


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    two_ranks(_worker, out)
    return out


@pytest.mark.slow  # 2 FSDP rank processes, every case: make test-ci
@pytest.mark.ci
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_sharded_base_takes_the_one_process_step(steps, case):
    one, one_stats = _step(case, SINGLE)
    ranks = [load_file(str(steps / f"{_name(case)}_r{r}.safetensors")) for r in range(2)]
    assert ranks[0].keys() == one.keys()
    for name, w in one.items():
        # the LoRA weights are replicated: the ranks agree exactly, and with one process within float rounding
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], w, atol=1e-6, rtol=0), (name, (ranks[0][name] - w).abs().max())
    start = {n: p for n, p in _policy()[0].named_parameters() if p.requires_grad}
    assert any(not torch.allclose(start[n], w, atol=1e-4) for n, w in one.items())  # the step moved them
    stats = load_file(str(steps / f"{_name(case)}_stats_r0.safetensors"))
    # counts/backward_seqs counts the rows that learn, not the fillers a rank runs to keep in step
    for key in ("loss", "kl", "ratio_mean", "entropy", "grad_norm", "counts/backward_seqs"):
        assert stats[key].item() == pytest.approx(float(one_stats[key]), rel=1e-5, abs=1e-7), key


@pytest.mark.slow  # 2 FSDP rank processes: make test-ci
@pytest.mark.ci
def test_each_rank_holds_half_the_base(steps):
    got = [json.loads((steps / f"memory_r{r}.json").read_text()) for r in range(2)]
    whole = got[0]["whole"]
    # tiny model, fp32: 100-token tied embedding (100 x 32) + 2 layers (4 x 32 x 32 attention + 3 x 32 x 64 MLP
    # + 2 norms of 32) + the final norm (32) = 3200 + 2 x 10304 + 32 = 23840 weights x 4 bytes = 95360 bytes
    assert whole == 95360 == sum(p.numel() * 4 for p in _policy()[0].parameters() if not p.requires_grad)
    # every weight is held once across the ranks, dim 0 of each split in two: 47680 bytes each (an odd row count
    # would put one more row on rank 0)
    assert got[0]["held"] + got[1]["held"] == whole
    for g in got:
        assert 0.45 * whole <= g["held"] <= 0.55 * whole, g
        assert g["line"].startswith("fsdp: base sharded over 2 ranks, ") and g["line"].endswith(" MB per rank")


@pytest.mark.slow  # 2 FSDP rank processes: make test-ci
@pytest.mark.ci
def test_leaving_the_group_ends_its_threads(steps):
    # FSDP's device mesh still holds the group after it is destroyed; its threads must end with it all the same
    for r in range(2):
        assert json.loads((steps / f"threads_r{r}.json").read_text()) == [], r


def test_whole_parts_are_the_embeddings_each_layer_and_the_rest():
    from grpo_cli.policy import load_tiny_random

    model, _ = load_tiny_random()
    parts = [(n, count, list(part)) for n, count, part in fsdp.whole_parts(model, main=True)]
    assert [(n, count) for n, count, _ in parts] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert parts[0][2] == ["model.embed_tokens.weight"] and parts[3][2] == ["model.norm.weight"]  # the head is tied
    assert {n.split(".")[2] for n in parts[1][2]} == {"0"} and {n.split(".")[2] for n in parts[2][2]} == {"1"}
    own = dict(model.named_parameters())
    assert sum(len(names) for *_, names in parts) == len(own)  # every weight once
    # no decoder layers to find: one part
    assert [list(part) for *_, part in fsdp.whole_parts(torch.nn.Sequential(torch.nn.Linear(2, 2)), True)] == [
        ["0.weight", "0.bias"]]
    assert all(part == {} for *_, part in fsdp.whole_parts(model, main=False))  # another rank keeps nothing


def test_one_process_is_not_sharded():
    policy, _ = _policy()
    assert fsdp.shard(policy, SINGLE).startswith("fsdp: one process, nothing to shard")
    assert not fsdp.sharded(policy)
    held, whole = fsdp.resident_bytes(policy)
    assert held == whole


def test_lockstep_pads_with_spare_rows_up_to_the_busiest_rank():
    class Two(World):  # the other rank runs 5 rows
        def max(self, tensor):
            return torch.maximum(tensor, torch.tensor([5]))

    world = Two(0, 2, 0)
    assert fsdp.lockstep([1, 4], 8, world) == ([1, 4, 0, 2, 3], [0, 2, 3])
    assert fsdp.lockstep([], 8, world) == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    assert fsdp.lockstep([0, 1, 2, 3, 4, 5], 8, world) == ([0, 1, 2, 3, 4, 5], [])
    assert ROWS == 16


# ---- end to end: torchrun, 2 ranks, the tiny model -------------------------------------------


def test_fsdp_config_checks_name_the_fix():
    from grpo_cli.commands import train
    from grpo_cli.config import compose

    cfg = compose("train", ["model=tiny", "trainer.fsdp=true", "trainer.gradient_checkpointing=true"])
    assert train.check_world(cfg, 2) == [] and train.check_world(cfg, 1) == []
    vllm = train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "sampler=vllm"]), 2)
    assert len(vllm) == 1 and vllm[0].endswith("set sampler=vllm_server, sampler=default, or trainer.fsdp=false")
    assert train.check_world(compose("train", ["model=tiny", "sampler=vllm"]), 2) == []
    # the server's push writes from rank 0 (LoRA: the whole adapter it holds; full: gathered one layer at a time)
    assert train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "sampler=vllm_server"]), 2) == []
    quant = train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "model.quantization=4bit"]), 2)
    assert len(quant) == 1 and "set model.quantization=null" in quant[0]
    rule = next(c for c in train.CHECKS if getattr(c, "key", None) == "trainer.fsdp")
    assert rule(compose("train", ["model=tiny", "trainer.fsdp=1"])) == [
        "trainer.fsdp (1) must be true or false; set trainer.fsdp=false"]


def test_fsdp_of_a_full_parameter_policy_passes_the_checks_and_in_process_vllm_is_still_refused():
    from grpo_cli.commands import train
    from grpo_cli.config import compose

    # every weight sharded (tests/unit/test_fsdp_full_sharding.py), as data parallel does without trainer.fsdp
    assert train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "model.finetune=full"]), 2) == []
    assert train.check_world(compose("train", ["model=tiny", "model.finetune=full"]), 2) == []
    vllm = train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "model.finetune=full",
                                               "sampler=vllm"]), 2)
    assert len(vllm) == 1 and vllm[0].endswith("set sampler=vllm_server, sampler=default, or trainer.fsdp=false")
    assert train.check_world(compose("train", ["model=tiny", "trainer.fsdp=true", "model.finetune=full",
                                               "sampler=vllm_server"]), 2) == []
