"""grpo_cli.update: a step whose weights come out non-finite is undone whole, the optimizer's state included; an
episode's environment tokens are context only: out of the loss, the KL, the entropy, lengths and normalizers."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import tiny_cfg


def optimizer_state(optimizer) -> dict:
    """Every slot of every parameter's state (step count, both moments), copied."""
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in slots.items()}
            for i, slots in optimizer.state_dict()["state"].items()}


def test_an_undone_step_restores_the_optimizer_state_too():
    from transformers import get_scheduler

    from grpo_cli import update
    from grpo_cli.algo import build_loss
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
    loss = build_loss(cfg.algo)
    batch = update.prepare(policy, rollout, advantages, loss, 1, 8, False)
    assert update.update(policy, optimizer, scheduler, batch).nonfinite_skipped == 0
    weights, state = [p.detach().clone() for p in params], optimizer_state(optimizer)
    # a finite gradient times an infinite rate: the step leaves the weights non-finite and is undone
    for group in optimizer.param_groups:
        group["lr"] = float("inf")
    assert update.update(policy, optimizer, scheduler, batch).nonfinite_skipped == 1
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = optimizer_state(optimizer)
    assert after.keys() == state.keys()
    for i in state:  # AdamW's step count and moments did not advance
        assert float(after[i]["step"]) == float(state[i]["step"]) == 1.0
        assert all(torch.equal(after[i][k], state[i][k]) for k in ("exp_avg", "exp_avg_sq"))


# ---- the update asks the loss what it reads (objective.Loss); the batch carries μ and the micro-batch size --------

class Declared:
    """A loss of another class than GRPOLoss: it declares what it reads, and its loss_fn records what it got."""

    needs_reference, needs_old_logprobs, needs_entropy, needs_entropy_grad, entropy_quantile = \
        False, False, True, False, None

    def __init__(self):
        self.calls = []  # (rows, old_logp given, entropy given) per loss_fn call

    def stat_names(self, with_sampling_logp: bool) -> list[str]:
        return []

    def for_batch(self, num_sequences, num_tokens, max_completion_length, entropy_threshold=None):
        def loss_fn(logp, old_logp, ref_logp, advantages, mask, sampling_logp=None, entropy=None):
            self.calls.append((logp.shape[0], old_logp is not None, entropy is not None))
            adv = advantages if advantages.dim() == 2 else advantages[:, None]
            return -(logp * adv * mask).sum() / num_sequences, {}

        return loss_fn


def test_the_update_reads_what_the_loss_declares_and_the_batch_carries_mu_and_micro_batches():
    from transformers import get_scheduler

    from grpo_cli import update
    from grpo_cli.objective import Loss

    cfg = tiny_cfg()
    policy, tokenizer = _policy(cfg)
    rollout = _episode_batch(tokenizer)
    loss = Declared()
    assert isinstance(loss, Loss)
    # μ = 2 but the loss reads no π_old: prepare runs no old-policy forward
    batch = update.prepare(policy, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), loss, 2, 3, False)
    assert batch.old_logp is None and batch.ref_logp is None
    assert (batch.loss, batch.num_iterations, batch.micro_batch_size) == (loss, 2, 3)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    stats = update.update(policy, optimizer, get_scheduler("constant", optimizer), batch)
    # 4 rows in micro-batches of 3 (3 + 1), twice (μ = 2); the loss got the entropy it declared it reads
    assert sum(rows for rows, _, _ in loss.calls) == 8 and stats.backward_seqs == 8
    assert all(has_entropy for _, _, has_entropy in loss.calls)
    assert stats.nonfinite_skipped == 0 and set(stats.tokens) == {"entropy"}


# ---- an episode's environment tokens: context for the model, never scored ------------------------------------------

def _episode_batch(tokenizer):
    """4 completions of one prompt, T = 10; rows 0, 1 and 3 hold tokens an environment added (a tool result between
    two sampled turns), row 2 is a plain completion; rows 1, 2 and 3 end before T."""
    from grpo_cli.rollout import Rollout

    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, 60, (1, 6), generator=g).repeat(4, 1)  # [4, 6]
    lengths = torch.tensor([10, 8, 9, 7])
    completion_mask = (torch.arange(10)[None, :] < lengths[:, None]).long()  # [4, 10]
    completion_ids = torch.where(completion_mask.bool(), torch.randint(3, 60, (4, 10), generator=g),
                                 tokenizer.pad_token_id)
    sampled = completion_mask.clone()
    sampled[0, 3:6] = 0  # 3 environment tokens after a 3-token call
    sampled[1, 2:6] = 0
    sampled[3, 1:3] = 0
    return Rollout(prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, [""] * 4,
                   [False] * 4, sampled_mask=sampled)


def _policy(cfg):
    """The tiny policy with a seeded nonzero adapter: it differs from the reference, so the KL is not 0."""
    from grpo_cli.policy import build_policy
    from tests.helpers.engines import set_adapter

    policy, tokenizer, _ = build_policy(cfg.model)
    set_adapter(policy, 7, scale=0.1)
    return policy, tokenizer


def _one_update(cfg, rollout, adv):
    """(batch, stats, policy after one SGD step of rate 1: its weights minus the gradient)."""
    from transformers import get_scheduler

    from grpo_cli import update
    from grpo_cli.algo import build_loss

    policy, _ = _policy(cfg)
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    loss = build_loss(cfg.algo)
    batch = update.prepare(policy, rollout, adv, loss, 1, 3, False)
    stats = update.update(policy, optimizer, get_scheduler("constant", optimizer), batch)
    return batch, stats, policy


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_environment_tokens_carry_no_loss_kl_entropy_or_length(loss_type):
    from grpo_cli.logprobs import sequence_logprobs
    from grpo_cli.metrics.stats import rollout_metrics
    from grpo_cli.policy import reference
    from grpo_cli.rewards.result import RewardResult

    cfg = tiny_cfg(f"algo.loss_type={loss_type}", "algo.beta=0.04", "algo.entropy_coef=0.01")
    before, tokenizer = _policy(cfg)
    rollout = _episode_batch(tokenizer)
    sampled = (rollout.completion_mask * rollout.sampled_mask).float()  # [4, 10]
    env = rollout.completion_mask.bool() & ~sampled.bool()  # [4, 10] the environment's tokens
    adv = torch.linspace(-1.5, 1.5, 40).view(4, 10) * rollout.completion_mask  # process-shaped [4, 10]
    b0, s0, p0 = _one_update(cfg, rollout, adv.masked_fill(env, 0.0))
    _, s1, p1 = _one_update(cfg, rollout, adv.masked_fill(env, 9.0))
    # what sits on an environment token moves neither the loss nor the gradient (SGD, rate 1: weights - gradient)
    assert s0.loss == pytest.approx(s1.loss, abs=1e-7) and s0.grad_norm == pytest.approx(s1.grad_norm, abs=1e-7)
    for a, b in zip(p0.parameters(), p1.parameters()):
        assert torch.allclose(a, b, atol=1e-7)
    # the normalizers count sampled tokens: 7 + 4 + 9 + 5 = 25 (dapo's token mean); the longest row in sampled
    # tokens is 9, not the padded width 10 (dr_grpo's divisor)
    assert float(b0.num_tokens) == 25.0 and b0.max_length == 9
    # the logged KL and entropy are means over the 25 sampled tokens only (the policy before its step, scored again)
    with torch.no_grad():
        scored = sequence_logprobs(before.eval(), rollout, with_entropy=True)
        with reference(before):
            d = sequence_logprobs(before, rollout).logp - scored.logp  # log(ref / policy), [4, 10]
    kl = (d.exp() - d - 1) * sampled  # k3 per token
    assert s0.tokens["kl"] == pytest.approx(float(kl.sum() / sampled.sum()), rel=1e-4)
    assert s0.tokens["entropy"] == pytest.approx(float((scored.entropy * sampled).sum() / sampled.sum()), rel=1e-4)
    # lengths count sampled tokens: 10 - 3, 8 - 4, 9, 7 - 2
    assert rollout.lengths == [7, 4, 9, 5]
    stats = rollout_metrics(RewardResult(rewards=[1.0, 0.0, 1.0, 0.0], per_function={}), rollout, 4)
    assert stats["completions/mean_length"] == 25 / 4 and stats["completions/max_length"] == 9
