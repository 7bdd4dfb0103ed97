"""scripts/push_cost.py's pieces: the perturbation between timed pushes makes the sampler push again (a LoRA policy
and a full one), and a way's row is the median of its pushes."""

from __future__ import annotations

import torch

from grpo_cli.policy import build_policy
from grpo_cli.rollout.vllm import fingerprint
from tests.helpers.runs import tiny_cfg
from tests.helpers.scripts import load_script

push_cost = load_script("push_cost")


def test_each_perturbation_changes_what_the_next_push_sends():
    g = torch.Generator().manual_seed(0)
    for finetune in ("lora", "full"):
        policy, _, _ = build_policy(tiny_cfg(f"model.finetune={finetune}").model)
        stamps = [fingerprint(policy)]
        for _ in range(2):
            push_cost.perturb(policy, g)
            stamps.append(fingerprint(policy))
        assert len(set(stamps)) == 3, finetune  # every timed push sends a new version


def test_a_row_is_the_median_of_its_pushes():
    row = push_cost.summary("in-process, adapter", [0.3, 0.1, 0.2, 0.9], [100] * 4, [2.0, 4.0])
    # sorted 0.1 0.2 0.3 0.9: median (0.2 + 0.3) / 2 = 0.25; sampling (2 + 4) / 2 = 3
    assert row == {"way": "in-process, adapter", "pushes": 4, "bytes": 100, "median_s": 0.25, "min_s": 0.1,
                   "max_s": 0.9, "sample_median_s": 3.0}
    assert push_cost.summary("server, full", [1.0], [7], [])["sample_median_s"] is None


def test_the_server_ways_time_each_push_through_the_samplers_own_push():
    import argparse

    from tests.fake_vllm import FakeVLLM

    scorer, _, _ = build_policy(tiny_cfg().model)  # the tiny model's base, as the server would hold it
    with FakeVLLM(scorer) as server:
        args = argparse.Namespace(url=server.base, overrides=["model=tiny"], pushes=2, sample=1)
        rows = [push_cost.measure(name, overrides, finetune, args) for name, overrides, finetune in push_cost.SERVER]
    loads = [b for p, b in server.requests if p == "/v1/load_lora_adapter"]
    assert len(loads) == 3 and len(server.reloaded) == 3  # each way: the start's push, then the 2 timed ones
    assert [(r["way"], r["pushes"], r["sample_median_s"]) for r in rows] == [("server, adapter", 2, None),
                                                                            ("server, full", 2, None)]
    lora = sum(p.numel() * 4 for n, p in scorer.named_parameters() if "lora_" in n)
    assert rows[0]["bytes"] == lora and rows[1]["bytes"] > lora  # fp32 A and B; every weight
