"""Two torchrun ranks and one vLLM server (a stand-in on loopback, tests/fake_vllm.py): the ranks' processes are
needed for the ranks, not the subject (tests/system holds those), so the case lives with the server's others."""

from __future__ import annotations

import json

import pytest

from tests.helpers import TORCHRUN_TINY, G, torchrun


@pytest.mark.slow
@pytest.mark.ci
def test_torchrun_two_ranks_share_one_server_and_only_rank_0_pushes(tmp_path):
    """sampler=vllm_server under torchrun: both ranks sample their own prompts from the one server, rank 0 alone
    loads each adapter version, and every rank's requests name the version loaded for its step (the broadcast)."""
    from grpo_cli.policy import build_policy
    from tests.fake_vllm import FakeVLLM
    from tests.helpers import tiny_cfg

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
