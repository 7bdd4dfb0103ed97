"""grpo_cli.update: a step whose weights come out non-finite is undone whole, the optimizer's state included."""

from __future__ import annotations

import torch

from tests.helpers import tiny_cfg


def optimizer_state(optimizer) -> dict:
    """Every slot of every parameter's state (step count, both moments), copied."""
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in slots.items()}
            for i, slots in optimizer.state_dict()["state"].items()}


def test_an_undone_step_restores_the_optimizer_state_too():
    from transformers import get_scheduler

    from grpo_cli import update
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy

    cfg = tiny_cfg()
    policy, tokenizer, _ = build_policy(cfg.model)
    torch.manual_seed(0)
    rollout = build(cfg.sampler).generate(policy, tokenizer, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
                                                              "assistant\n"] * 2, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5])
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build(cfg.optimizer)(params=params)
    scheduler = get_scheduler("constant", optimizer)
    loss = build(cfg.algo.loss)
    batch = update.prepare(policy, rollout, advantages, loss, 1, 8, False)
    assert update.update(policy, optimizer, scheduler, batch, loss, 1, 8, None).nonfinite_skipped == 0
    weights, state = [p.detach().clone() for p in params], optimizer_state(optimizer)
    # a finite gradient times an infinite rate: the step leaves the weights non-finite and is undone
    for group in optimizer.param_groups:
        group["lr"] = float("inf")
    assert update.update(policy, optimizer, scheduler, batch, loss, 1, 8, None).nonfinite_skipped == 1
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = optimizer_state(optimizer)
    assert after.keys() == state.keys()
    for i in state:  # AdamW's step count and moments did not advance
        assert float(after[i]["step"]) == float(state[i]["step"]) == 1.0
        assert all(torch.equal(after[i][k], state[i][k]) for k in ("exp_avg", "exp_avg_sq"))
