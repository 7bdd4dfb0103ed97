"""Rollouts one step ahead (algo.max_staleness=1) on the tiny model against a stand-in vLLM server: each step after
the first trains on rollouts its policy's previous version sampled (sampler/staleness 1, never more), with the
prompts and seeds of the synchronous loop, and a resume trains on the rollouts the checkpoint kept instead of
sampling them again."""

from __future__ import annotations

import json
import shutil

import pytest

from grpo_cli.policy import build_policy
from grpo_cli.rollout.ahead import shared_cores
from tests.fake_vllm import FakeVLLM
from tests.helpers.cli import run_cli
from tests.helpers.runs import TINY, metrics, tiny_cfg


@pytest.fixture()
def server():
    scorer, tokenizer, _ = build_policy(tiny_cfg().model)  # the runs' base: the same seeded tiny model
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id) as fake:
        yield fake


def sampled(server) -> list[dict]:
    return [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]


def train(server, run_dir, *extra):
    # the stand-in's log-probs are no model's: the guard's logp_gap tripwire would stop the run
    out = run_cli(["train", *TINY, "trainer.guard=null", "sampler=vllm_server", f"sampler.url={server.base}",
                   f"sampler.adapter_dir={run_dir.parent / 'pushed'}", "trainer.save_every=1",
                   f"hydra.run.dir={run_dir}", *extra])
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_each_step_trains_on_rollouts_sampled_one_update_earlier(server, tmp_path):
    out = train(server, tmp_path / "ahead", "algo.max_staleness=1", "trainer.max_steps=3")
    # the stand-in answers on this machine and the trainer is not pinned here: the line on pinning them, once
    said = [line for line in out.stderr.splitlines() if line.startswith("rollouts ahead (algo.max_staleness=1)")]
    assert len(said) == (shared_cores(1, server.base, "cpu") is not None)
    assert [m["sampler/staleness"] for m in metrics(tmp_path / "ahead")] == [0, 1, 1]
    loads = [b["lora_name"] for p, b in server.requests if p == "/v1/load_lora_adapter"]
    names = [b["model"] for b in sampled(server)]
    # step 1 sampled now and step 2 ahead, both from the first version; step 3 from the second; none for step 4
    assert names == [loads[0]] * 4 + [loads[1]] * 2 and len(loads) == 3
    ahead_seeds = sorted(b["seed"] for b in sampled(server))

    server.requests.clear()
    train(server, tmp_path / "sync", "trainer.max_steps=3")  # the synchronous loop: the same prompts and seeds
    assert sorted(b["seed"] for b in sampled(server)) == ahead_seeds
    assert "sampler/staleness" not in metrics(tmp_path / "sync")[0]


def test_a_resume_trains_on_the_rollouts_its_checkpoint_kept(server, tmp_path):
    run = tmp_path / "run"
    train(server, run, "algo.max_staleness=1", "trainer.max_steps=3")
    straight = metrics(run)
    state = json.loads((run / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert list(state["ahead"]) == ["2"] and state["ahead"]["2"]["version"] == 0  # step 2's, sampled before update 1
    for later in ("step_000002", "step_000003"):  # back to step 1, as a kill after its checkpoint would leave it
        shutil.rmtree(run / "checkpoints" / later)
    server.requests.clear()
    out = run_cli(["train", f"resume={run}", "trainer.max_steps=3"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(sampled(server)) == 2  # step 3's prompts only: step 2 trains on the kept rollouts
    resumed = metrics(run)
    assert [m["sampler/staleness"] for m in resumed] == [0, 1, 1]
    keys = ("reward", "loss", "kl")
    assert [{k: m.get(k) for k in keys} for m in resumed] == [{k: m.get(k) for k in keys} for m in straight]
