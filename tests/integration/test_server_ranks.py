"""Two torchrun ranks and one vLLM server (a stand-in on loopback, tests/fake_vllm.py): the ranks' processes are
needed for the ranks, not the subject (tests/system holds those), so the case lives with the server's others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.batches import G
from tests.helpers.ranks import TORCHRUN_TINY, torchrun


@pytest.mark.slow
@pytest.mark.ci
def test_torchrun_two_ranks_share_one_server_and_only_rank_0_pushes(tmp_path):
    """sampler=vllm_server under torchrun: both ranks sample their own prompts from the one server, rank 0 alone
    loads each adapter version, and every rank's requests name the version loaded for its step (the broadcast)."""
    from grpo_cli.policy import build_policy
    from tests.fake_vllm import FakeVLLM
    from tests.helpers.runs import tiny_cfg

    scorer, tokenizer, _ = build_policy(tiny_cfg().model)  # the ranks' base: the same seeded tiny model
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id) as server:
        # the stand-in's log-probs are no model's: the guard's logp_gap tripwire would stop the run
        torchrun(tmp_path, "train", *TORCHRUN_TINY, "trainer.max_steps=2", "trainer.guard=null", "sampler=vllm_server",
                 f"sampler.url={server.base}", f"sampler.adapter_dir={tmp_path / 'pushed'}")
    runs = list((tmp_path / "outputs" / "train").glob("*/*"))
    assert len(runs) == 1, runs
    loads = [b["lora_name"] for p, b in server.requests if p == "/v1/load_lora_adapter"]
    assert len(loads) == len(set(loads)) == 2  # at the start and after step 1, once each
    sampled = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]
    assert len(sampled) == 2 * 4  # 2 steps x 4 prompts, a request per prompt whichever rank holds it
    assert [b["model"] for b in sampled].count(loads[0]) == 4 and [b["model"] for b in sampled].count(loads[1]) == 4
    rows = [json.loads(line) for line in (runs[0] / "completions.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in rows} == {0, 1} and len(rows) == 2 * 4 * G


def _loads(server) -> list[dict]:
    return [b for p, b in server.requests if p == "/v1/load_lora_adapter"]


def _sampled(server) -> list[dict]:
    return [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]


# slow, not in CI: tests/unit/rollout/test_server_push_fsdp.py holds the push's cases on 2 ranks in the fast tier;
# these are the command's own path (setup, steps, checkpoints, resume)
@pytest.mark.slow
def test_torchrun_fsdp_lora_samples_from_the_server_and_a_resume_pushes_again(tmp_path):
    """trainer.fsdp=true, LoRA: 3 steps, rank 0 loading each adapter version (the adapter is whole on every rank),
    then a resume to step 4 that pushes the checkpoint's adapter before it samples."""
    from safetensors.torch import load_file

    from grpo_cli.policy import build_policy
    from tests.fake_vllm import FakeVLLM
    from tests.helpers.runs import tiny_cfg

    scorer, tokenizer, _ = build_policy(tiny_cfg().model)
    run = tmp_path / "run"
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id) as server:
        done = torchrun(tmp_path, "train", *TORCHRUN_TINY, "trainer.fsdp=true", "trainer.guard=null",
                        "sampler=vllm_server", f"sampler.url={server.base}",
                        f"sampler.adapter_dir={tmp_path / 'pushed'}", f"hydra.run.dir={run}")
        assert "fsdp: base sharded over 2 ranks" in done.stderr
        assert len(_loads(server)) == 3  # at the start, after step 1 and after step 2
        torchrun(tmp_path, "train", f"resume={run}", "trainer.max_steps=4")
    loads = _loads(server)
    # the resume's own: at its start (the fresh adapter: the engine starts before the checkpoint loads), then the
    # step-3 adapter it loaded, before step 4 samples
    assert len(loads) == len({b["lora_name"] for b in loads}) == 5
    sampled = _sampled(server)
    assert len(sampled) == 4 * 4 and [b["model"] for b in sampled[-4:]] == [loads[-1]["lora_name"]] * 4
    pushed = load_file(Path(loads[-1]["lora_path"]) / "adapter_model.safetensors")
    saved = load_file(run / "checkpoints" / "step_000003" / "adapter_model.safetensors")
    assert pushed.keys() == saved.keys() and all(torch.equal(pushed[k], saved[k]) for k in saved)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.slow
def test_torchrun_fsdp_full_pushes_every_weight_gathered_a_layer_at_a_time(tmp_path):
    """trainer.fsdp=true, model.finetune=full: 2 steps; each push is a file per part of the model that rank 0 wrote
    from the ranks' gathers, equal to the weights the checkpoint gathered whole (the initial ones at the start)."""
    from safetensors.torch import load_file

    from grpo_cli.policy import build_policy, load_tiny_random
    from tests.fake_vllm import FakeVLLM
    from tests.helpers.runs import tiny_cfg

    scorer, tokenizer, _ = build_policy(tiny_cfg().model)
    run = tmp_path / "run"
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id) as server:
        done = torchrun(tmp_path, "train", *TORCHRUN_TINY, "model.finetune=full", "optimizer.lr=0.01",
                        "trainer.max_steps=2", "trainer.fsdp=true", "trainer.guard=null", "sampler=vllm_server",
                        f"sampler.url={server.base}", f"sampler.adapter_dir={tmp_path / 'pushed'}",
                        f"hydra.run.dir={run}")
    assert "fsdp: every weight, its gradient and optimizer state sharded over 2 ranks" in done.stderr
    assert len(server.reloaded) == 2  # at the start and after step 1, from rank 0 alone
    initial = dict(load_tiny_random()[0].named_parameters())
    step_1 = load_file(run / "checkpoints" / "step_000001" / "model.safetensors")
    for (files, pushed), expected in zip(server.reloaded, (initial, step_1), strict=True):
        assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
        # every weight, and the tied LM head under its own name too (vLLM's CPU build refreshes its head from it)
        assert pushed.keys() == {*expected, "lm_head.weight"}
        assert all(torch.equal(pushed[k], expected[k]) for k in expected)
        assert torch.equal(pushed["lm_head.weight"], expected["model.embed_tokens.weight"])
    assert not all(torch.equal(step_1[k], initial[k]) for k in initial)  # step 1 moved the weights
    assert [b["model"] for b in _sampled(server)] == ["base"] * 2 * 4
