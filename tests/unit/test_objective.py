"""grpo_cli.objective: numbers worked by hand, and plain-loop references on random ragged inputs."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from grpo_cli.objective import (
    AGGREGATIONS,
    GSPO_EPSILON_HIGH,
    GSPO_EPSILON_LOW,
    GRPOLoss,
    LossSettings,
    choose,
    clip_fractions,
    clipped_surrogate,
    entropy_mask,
    grpo_loss,
    high_entropy_threshold,
    importance_ratio,
    is_correction_weights,
    kl_divergence,
    masked_mean,
    outcome_advantages,
    process_advantages,
    sparse_process_advantages,
    step_coordinates,
    truncated_is_weight,
)
from tests.helpers.batches import is_correction_batch as sampler_batch

E = 1e-4  # the default eps added to the std
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")  # the loss types with PPO's clipped term (the others: objective/)


def close(x, expected, tol=1e-4):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --------------------------------------------------------------------------- outcome advantages


def test_paper_example_plus_minus_one():
    # G=4, rewards +1,-1,+1,-1: mean 0, population std sqrt(4/4) = 1 -> ±1 / (1 + 1e-4)
    adv = outcome_advantages(torch.tensor([1.0, -1.0, 1.0, -1.0]), 4)
    assert close(adv, [1, -1, 1, -1], tol=2e-4)
    assert close(adv, [1 / (1 + E), -1 / (1 + E)] * 2, tol=1e-6)


def test_population_and_sample_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5; deviations ±0.5; population var 4·0.25/4 = 0.25 -> std 0.5 -> ±0.5/0.5 = ±1
    assert close(outcome_advantages(r, 4), [1, -1, -1, 1], tol=2e-4)
    # sample var 4·0.25/3 = 1/3 -> std sqrt(1/3) = 0.57735 -> 0.5/0.57735 = 0.866
    assert close(outcome_advantages(r, 4, std="sample"), [0.866, -0.866, -0.866, 0.866], tol=2e-4)


def test_batch_scale_and_no_scale():
    # groups [0, 2] and [2, 4] (G=2): group means 1 and 3 -> centered [-1, 1, -1, 1]
    r = torch.tensor([0.0, 2.0, 2.0, 4.0])
    # group scale: each group's population std is 1 -> ±1
    assert close(outcome_advantages(r, 2), [-1, 1, -1, 1], tol=2e-4)
    # batch scale: batch mean 2, deviations [-2, 0, 0, 2], population var 8/4 = 2, std 1.41421
    # -> ±1 / 1.41421 = ±0.70711 (the mean stays per group)
    assert close(outcome_advantages(r, 2, scale="batch"), [-0.70711, 0.70711, -0.70711, 0.70711], tol=1e-4)
    # batch, sample std: var 8/3, std 1.63299 -> ±1 / 1.63299 = ±0.61237
    assert close(outcome_advantages(r, 2, scale="batch", std="sample"),
                 [-0.61237, 0.61237, -0.61237, 0.61237], tol=1e-4)
    # none: just r - group mean
    assert close(outcome_advantages(r, 2, scale="none"), [-1, 1, -1, 1], tol=0)


def test_nan_reward_gets_zero_and_is_left_out():
    # scored rewards 1, 0, 0: mean 1/3; deviations 2/3, -1/3, -1/3
    # population var (4/9 + 1/9 + 1/9) / 3 = 2/9 -> std 0.47140
    # advantages 0.66667/0.47140 = 1.41421, -0.33333/0.47140 = -0.70711; the NaN one 0
    adv = outcome_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 4)
    assert close(adv, [1.41421, 0.0, -0.70711, -0.70711], tol=5e-4)
    # an all-NaN group and a group with one scored reward (sample std: G-1 = 0) give zeros, not NaN
    adv = outcome_advantages(torch.tensor([float("nan")] * 2 + [3.0, float("nan")]), 2, std="sample")
    assert torch.equal(adv, torch.zeros(4))
    # NaN in batch scale: left out of the batch std too. Scored [0, 2 | 2] -> centered [-1, 1, 0, 0]
    # batch values 0, 2, 2: mean 4/3, var ((16 + 4 + 4)/9) / 3 = 8/9 -> std 0.94281 -> ±1.06066
    adv = outcome_advantages(torch.tensor([0.0, 2.0, 2.0, float("nan")]), 2, scale="batch")
    assert close(adv, [-1.06066, 1.06066, 0.0, 0.0], tol=2e-4)


def test_equal_rewards_give_zero():
    # mean 1, std 0 -> 0 / (0 + eps) = 0
    assert torch.equal(outcome_advantages(torch.ones(4), 4), torch.zeros(4))


def test_outcome_errors():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        outcome_advantages(torch.zeros(5), 4)
    with pytest.raises(ValueError, match="scale"):
        outcome_advantages(torch.zeros(4), 4, scale="prompt")
    with pytest.raises(ValueError, match="std"):
        outcome_advantages(torch.zeros(4), 4, std="biased")
    with pytest.raises(ValueError, match="1-D"):
        outcome_advantages(torch.zeros(2, 2), 2)


def ref_outcome(rewards, g, scale, std, eps):
    """One group at a time, in plain floats."""
    ddof = 1 if std == "sample" else 0

    def sd(xs):
        if not xs:
            return 0.0
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / max(len(xs) - ddof, 1))

    scored_all = [x for x in rewards if not math.isnan(x)]
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        scored = [x for x in group if not math.isnan(x)]
        mu = sum(scored) / len(scored) if scored else 0.0
        s = sd(scored) if scale == "group" else sd(scored_all)
        for x in group:
            if math.isnan(x):
                out.append(0.0)
            elif scale == "none":
                out.append(x - mu)
            else:
                out.append((x - mu) / (s + eps))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_outcome_matches_loop(seed):
    rng = random.Random(seed)
    for scale in ("group", "batch", "none"):
        for std in ("population", "sample"):
            g = rng.randint(1, 6)
            rewards = [float("nan") if rng.random() < 0.2 else rng.choice([0.0, 1.0, rng.gauss(0, 2)])
                       for _ in range(g * rng.randint(1, 5))]
            fast = outcome_advantages(torch.tensor(rewards, dtype=torch.float64), g, scale=scale, std=std)
            assert close(fast, ref_outcome(rewards, g, scale, std, 1e-4), tol=1e-9), (scale, std, rewards)


# --------------------------------------------------------------------------- process advantages


def test_process_two_completions_by_hand():
    # A: step rewards [1, 0] ending at tokens [1, 3]; B: [-1] ending at token 2; G=2, length 5
    # all step rewards of the group: 1, 0, -1 -> mean 0, population std sqrt((1+0+1)/3) = 0.8165
    # normalized: 1/0.8165 = 1.2247, 0, -1.2247 (eps 1e-4 makes it 1.22459)
    # A: t=0,1: steps ending >= t are both -> 1.2247 + 0; t=2,3: only the step ending at 3 -> 0;
    #    t=4: after the last step -> 0
    # B: t=0..2: -1.2247; t=3,4: 0
    adv = process_advantages([[1.0, 0.0], [-1.0]], [[1, 3], [2]], 2, 5)
    a = 1 / (math.sqrt(2 / 3) + E)
    assert adv.shape == (2, 5) and adv.dtype == torch.float32
    assert close(adv, [[a, a, 0, 0, 0], [-a, -a, -a, 0, 0]], tol=1e-5)
    assert close(a, 1.2246, tol=1e-4)


def test_process_sum_of_later_steps():
    # one completion and one without steps (G=2): steps [2, 0, -2] end at [0, 2, 3], length 4
    # mean 0, population std sqrt(8/3) = 1.63299 -> normalized 1.22474, 0, -1.22474
    # t=0: 1.22474 + 0 - 1.22474 = 0; t=1,2: 0 - 1.22474; t=3: -1.22474
    adv = process_advantages([[2.0, 0.0, -2.0], []], [[0, 2, 3], []], 2, 4)
    b = 2 / (math.sqrt(8 / 3) + E)
    assert close(adv, [[0, -b, -b, -b], [0, 0, 0, 0]], tol=1e-5)


def test_process_no_steps_gives_zeros():
    assert torch.equal(process_advantages([[], []], [[], []], 2, 3), torch.zeros(2, 3))
    # a group with steps next to a group without
    adv = process_advantages([[1.0], [0.0], [], []], [[0], [0], [], []], 2, 2)
    assert close(adv[0], [0.99990, 0], tol=1e-4)   # (1 - 0.5) / (0.5 + 1e-4)
    assert torch.equal(adv[2:], torch.zeros(2, 2))


def test_process_several_steps_on_one_token():
    # A: steps [1, -1, -1] ending at tokens [0, 2, 2] (a line, then two steps that end with the completion);
    # B: [1] at token 2; G=2, length 3. The four rewards 1, -1, -1, 1: mean 0, population std 1 (+eps 1e-4)
    # A: t=0: (1 - 1 - 1) / 1.0001 = -0.99990; t=1,2: -2 / 1.0001 = -1.99980. B: 0.99990 everywhere.
    # Merged into one step per token (A: [1, -2]; rewards 1, -2, 1: mean 0, std sqrt(2)) A's t=0 would be -0.70706
    adv = process_advantages([[1.0, -1.0, -1.0], [1.0]], [[0, 2, 2], [2]], 2, 3)
    assert close(adv, [[-0.99990, -1.99980, -1.99980], [0.99990] * 3], tol=1e-5)


def test_process_advantages_from_coordinates():
    # test_process_several_steps_on_one_token's group as a sparse [2, 3] in coordinate form: A's steps 1, -1, -1 on
    # tokens 0, 2, 2 and B's 1 on token 2 -> rows [0, 0, 0, 1], tokens [0, 2, 2, 2]: the two steps on A's token 2
    # stay two entries (merged, A's t=0 would be -0.70706, not -0.99990)
    rows, tokens, rewards = step_coordinates([[1.0, -1.0, -1.0], [1.0]], [[0, 2, 2], [2]], 3)
    assert rows.tolist() == [0, 0, 0, 1] and tokens.tolist() == [0, 2, 2, 2]
    assert rewards.tolist() == [1.0, -1.0, -1.0, 1.0] and rewards.dtype == torch.float32
    adv = sparse_process_advantages(rewards, rows, tokens, (2, 3), 2)
    assert close(adv, [[-0.99990, -1.99980, -1.99980], [0.99990] * 3], tol=1e-5)
    # the order of the entries does not matter: B's step first
    order = torch.tensor([3, 0, 1, 2])
    assert close(sparse_process_advantages(rewards[order], rows[order], tokens[order], (2, 3), 2), adv, tol=1e-6)
    # no steps at all: zeros of the shape
    rows, tokens, rewards = step_coordinates([[], []], [[], []], 4)
    assert torch.equal(sparse_process_advantages(rewards, rows, tokens, (2, 4), 1), torch.zeros(2, 4))
    rows, tokens, rewards = step_coordinates([[1.0, -1.0, -1.0], [1.0]], [[0, 2, 2], [2]], 3)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        sparse_process_advantages(rewards, rows, tokens, (3, 3), 2)


def test_process_errors():
    with pytest.raises(ValueError, match="step_ends has"):
        process_advantages([[1.0]], [], 1, 3)
    with pytest.raises(ValueError, match="2 step rewards but 1 step ends"):
        process_advantages([[1.0, 2.0]], [[0]], 1, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        process_advantages([[1.0, 2.0]], [[2, 1]], 1, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        process_advantages([[1.0]], [[3]], 1, 3)          # end must be < length
    with pytest.raises(ValueError, match="non-decreasing"):
        process_advantages([[1.0]], [[-1]], 1, 3)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        process_advantages([[1.0]] * 3, [[0]] * 3, 2, 3)


def ref_process(step_rewards, step_ends, g, length, eps):
    out = []
    for start in range(0, len(step_rewards), g):
        scored = [r for rs in step_rewards[start:start + g] for r in rs if not math.isnan(r)]
        mu = sum(scored) / len(scored) if scored else 0.0
        sd = math.sqrt(sum((r - mu) ** 2 for r in scored) / len(scored)) if scored else 0.0
        for rs, es in zip(step_rewards[start:start + g], step_ends[start:start + g]):
            norm = [0.0 if math.isnan(r) else (r - mu) / (sd + eps) for r in rs]
            out.append([sum(n for n, e in zip(norm, es) if e >= t) for t in range(length)])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_process_matches_loop(seed):
    rng = random.Random(seed)
    g, length = rng.randint(1, 5), rng.randint(1, 9)
    rewards, ends = [], []
    for _ in range(g * rng.randint(1, 4)):
        k = rng.randint(0, min(4, length))                # 0 steps included
        ends.append(sorted(rng.choices(range(length), k=k)))  # several steps may end on one token
        rewards.append([float("nan") if rng.random() < 0.1 else rng.gauss(0, 1) for _ in range(k)])
    fast = process_advantages(rewards, ends, g, length)
    assert close(fast, ref_process(rewards, ends, g, length, 1e-4), tol=1e-5)


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators():
    logp = torch.full((3,), -1.0, dtype=torch.float64)
    ref = torch.tensor([0.0, -15.0, -30.0], dtype=torch.float64)
    # k1 = logp - ref = -1 - 0, -1 + 15, -1 + 30
    assert close(kl_divergence(logp, ref, "k1"), [-1, 14, 29], tol=0)
    # k2 = ½ k1²: ½·1, ½·196, ½·841
    assert close(kl_divergence(logp, ref, "k2"), [0.5, 98, 420.5], tol=0)
    # k3 = exp(d) - d - 1 with d = ref - logp = 1, -14, -29:
    # e - 1 - 1 = 0.71828; exp(-14) + 14 - 1 = 13.0000008; exp(-29) + 29 - 1 = 28.0000000
    k3 = kl_divergence(logp, ref, "k3")
    assert close(k3, [math.e - 2, 13 + math.exp(-14), 28 + math.exp(-29)], tol=1e-12)
    assert close(k3, [0.7183, 13, 28], tol=1e-4)
    # default is k3; no clamping of large gaps
    assert torch.equal(kl_divergence(logp, ref), k3)
    with pytest.raises(ValueError, match="k1"):
        kl_divergence(logp, ref, "k4")


def test_k3_is_nonnegative_and_exact_near_zero():
    # d = 1e-6: exp(d) - 1 - d ≈ d²/2 = 5e-13. In fp32 expm1(d) - d keeps it to ~5e-14, while
    # exp(d) - 1 - d gives -4.6e-8: exp(1e-6) rounds to a multiple of 1.19e-7 (fp32 spacing near 1)
    # and the "always >= 0" estimator goes negative
    logp = torch.tensor([0.0, -1.0, 2.0], dtype=torch.float32)
    ref = torch.tensor([1e-6, -3.0, 1.0], dtype=torch.float32)
    k3 = kl_divergence(logp, ref)
    assert (k3 >= 0).all()
    assert close(k3[0], 5e-13, tol=1e-13)


# --------------------------------------------------------------------------- loss


def logps_with_ratios(ratios, old=-1.0):
    """[1, T] logp (requires grad) and old_logp such that exp(logp - old) = ratios."""
    old_logp = torch.full((1, len(ratios)), old, dtype=torch.float64)
    logp = (old_logp + torch.tensor([ratios], dtype=torch.float64).log()).requires_grad_()
    return logp, old_logp


def test_clipped_objective_by_hand():
    # ratios [0.5, 1, 1.5], advantages [1, -1, 2], ε=0.2, β=0:
    # 0.5·1 = 0.5 (clip to 0.8·1 = 0.8 is larger, min keeps 0.5)
    # min(1·-1, 1·-1) = -1
    # min(1.5·2 = 3, 1.2·2 = 2.4) = 2.4
    # token mean (0.5 - 1 + 2.4) / 3 = 0.6333 -> loss -0.6333
    logp, old = logps_with_ratios([0.5, 1.0, 1.5])
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, stats = grpo_loss(logp, old, None, adv, torch.ones(1, 3), LossSettings(beta=0.0))
    assert close(loss, -0.63333, tol=1e-5)
    # token 2: A>0, ρ=1.5 > 1.2 -> high clip, 1 of 3 tokens; no low clip (ρ=0.5 has A>0)
    assert close(stats["clip_ratio/high_mean"], 1 / 3, tol=1e-9)
    assert close(stats["clip_ratio/low_mean"], 0.0, tol=0)
    assert close(stats["clip_ratio/region_mean"], 1 / 3, tol=1e-9)
    # (0.5 + 1 + 1.5) / 3 = 1
    assert close(stats["ratio_mean"], 1.0, tol=1e-9)
    assert close(stats["kl"], 0.0, tol=0)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_clip_higher():
    # ε_low 0.2, ε_high 0.28: ratio 1.5, A=2 -> min(3, 1.28·2 = 2.56) = 2.56 -> loss -2.56
    logp, old = logps_with_ratios([1.5])
    loss, _ = grpo_loss(logp, old, None, torch.tensor([2.0]), torch.ones(1, 1),
                        LossSettings(beta=0.0, epsilon_high=0.28))
    assert close(loss, -2.56, tol=1e-9)


def test_clipped_tokens_have_zero_gradient():
    # one sequence of T=5 tokens, grpo loss = -1/5 Σ min(ρA, clip(ρ)A); ∂/∂logp of an unclipped
    # token is -ρA/5 (∂ρ/∂logp = ρ), of a clipped one 0:
    # ρ 0.5, A -1: min(-0.5, 0.8·-1 = -0.8) = clipped (low)  -> 0
    # ρ 1.5, A  1: min( 1.5, 1.2·1  =  1.2) = clipped (high) -> 0
    # ρ 0.5, A  1: min( 0.5, 0.8)    -> -0.5·1/5  = -0.1
    # ρ 1.5, A -1: min(-1.5, -1.2)   -> -1.5·-1/5 =  0.3
    # ρ 1,   A  1:                      -1·1/5    = -0.2
    logp, old = logps_with_ratios([0.5, 1.5, 0.5, 1.5, 1.0])
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, stats = grpo_loss(logp, old, None, adv, torch.ones(1, 5), LossSettings(beta=0.0))
    loss.backward()
    assert close(logp.grad, [[0.0, 0.0, -0.1, 0.3, -0.2]], tol=1e-12)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0
    # low 1/5, high 1/5, region 2/5; ratio mean (0.5 + 1.5 + 0.5 + 1.5 + 1) / 5 = 1
    assert close(stats["clip_ratio/low_mean"], 0.2, tol=1e-12)
    assert close(stats["clip_ratio/high_mean"], 0.2, tol=1e-12)
    assert close(stats["clip_ratio/region_mean"], 0.4, tol=1e-12)
    assert close(stats["ratio_mean"], 1.0, tol=1e-12)


def test_on_policy_gradient_is_policy_gradient():
    # old = logp.detach() -> ρ = 1, never clipped; β = 0; grpo over T=4 tokens:
    # loss = -1/4 Σ_t ρ_t A -> ∂loss/∂logp_t = -A/4 = -0.5/4 = -0.125 (REINFORCE with a baseline)
    torch.manual_seed(0)
    logp = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(logp, logp.detach(), None, torch.tensor([0.5]), torch.ones(1, 4), LossSettings(beta=0.0))
    loss.backward()
    assert close(loss, -0.5, tol=1e-12)                  # mean of ρA = 0.5
    assert close(logp.grad, [[-0.125] * 4], tol=1e-12)
    assert close(stats["ratio_mean"], 1.0, tol=0)
    # old_logp=None means the same thing
    logp.grad = None
    grpo_loss(logp, None, None, torch.tensor([0.5]), torch.ones(1, 4), LossSettings(beta=0.0))[0].backward()
    assert close(logp.grad, [[-0.125] * 4], tol=1e-12)


# ragged batch for the aggregations: N=2, T=3; ρ = 1, β = 0, so each token's objective is its A
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
ADV = torch.tensor([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])   # 99: masked, must not count


def ragged_loss(loss_type, **kw):
    logp = torch.zeros(2, 3, requires_grad=True)
    return grpo_loss(logp, logp.detach(), None, ADV, MASK, LossSettings(beta=0.0, loss_type=loss_type), **kw)[0]


def test_loss_types_by_hand():
    # unmasked objectives: sequence 0: 1, 2; sequence 1: 3. Sum 6, 3 unmasked tokens.
    # grpo: sequence means 1.5 and 3 -> (1.5 + 3) / 2 = 2.25
    assert close(ragged_loss("grpo"), -2.25)
    # bnpo: 6 / 3 = 2
    assert close(ragged_loss("bnpo"), -2.0)
    # dr_grpo: 6 / (N·T) = 6 / 6 = 1; with max_completion_length 4: 6 / (2·4) = 0.75
    assert close(ragged_loss("dr_grpo"), -1.0)
    assert close(ragged_loss("dr_grpo", max_completion_length=4), -0.75)
    # dapo: 6 / 3 = 2 by default; with the accumulated batch's 12 tokens: 6 / 12 = 0.5
    assert close(ragged_loss("dapo"), -2.0)
    assert close(ragged_loss("dapo", normalizer=12), -0.5)
    assert close(ragged_loss("dapo", normalizer=torch.tensor(12.0)), -0.5)


def test_the_pieces_by_hand():
    # ρ [0.5, 1.5, 0.5, 1.5], A [-1, 1, 1, -1], ε 0.2:
    # min(-0.5, 0.8·-1 = -0.8) = -0.8; min(1.5, 1.2) = 1.2; min(0.5, 0.8) = 0.5; min(-1.5, -1.2) = -1.5
    ratio = torch.tensor([[0.5, 1.5, 0.5, 1.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    assert close(clipped_surrogate(ratio, adv, 0.2, 0.2), [[-0.8, 1.2, 0.5, -1.5]], tol=1e-12)
    # clipped: token 0 low, token 1 high; with token 3 masked out: shares of 3 counted tokens
    clip = clip_fractions(ratio, adv, torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64), 0.2, 0.2)
    assert close(clip.low, 1 / 3, tol=1e-12) and close(clip.high, 1 / 3, tol=1e-12)
    assert close(clip.region, 2 / 3, tol=1e-12)


def test_aggregations_and_micro_batch_weights_by_hand():
    # MASK's objectives (0 where masked): [1, 2, 0], [3, 0, 0]; sum 6, 3 tokens, N = 2, T = 3
    objective, m = torch.where(MASK.bool(), ADV, 0.0), MASK.float()
    reduce = {name: a.reduce(objective, m, None, None) for name, a in AGGREGATIONS.items()}
    # grpo (1.5 + 3) / 2; bnpo 6 / 3; dr_grpo 6 / (2·3); dapo 6 / 3; cispo as dapo; sapo and gmpo as grpo
    assert close(torch.stack(list(reduce.values())), [2.25, 2.0, 1.0, 2.0, 2.0, 2.25, 2.25])
    # a micro-batch of 1 of 2 rows holding 2 of 3 tokens: grpo, dr_grpo, sapo, gmpo 1/2; bnpo 2/3; dapo, cispo 1
    # (they divide by the batch's tokens themselves)
    weights = {name: a.micro_batch_weight(1, 2, torch.tensor(2.0), torch.tensor(3.0))
               for name, a in AGGREGATIONS.items()}
    assert weights == pytest.approx({"grpo": 0.5, "bnpo": 2 / 3, "dr_grpo": 0.5, "dapo": 1.0, "cispo": 1.0,
                                     "sapo": 0.5, "gmpo": 0.5})


def test_an_unknown_name_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"loss_type \('ppo'\) must be one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', "):
        choose("loss_type", "ppo", AGGREGATIONS)


def test_grpo_empty_sequence_counts_in_mean():
    # sequence 1 has no unmasked token: it contributes 0 but counts: (1.5 + 0) / 2 = 0.75
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = grpo_loss(logp, None, None, ADV, torch.tensor([[1, 1, 0], [0, 0, 0]]), LossSettings(beta=0.0))
    assert close(loss, -0.75)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and (logp.grad[1] == 0).all()


def test_kl_penalty_by_hand():
    # logp -1, ref 0 on every token -> k3 = e - 2 = 0.71828; β 0.1 -> each objective A - 0.071828
    # grpo on the ragged batch: 2.25 - 0.071828 = 2.17817; stats kl = 0.71828
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, stats = grpo_loss(logp, None, torch.zeros(2, 3), ADV, MASK, LossSettings(beta=0.1))
    assert close(loss, -(2.25 - 0.1 * (math.e - 2)))
    assert close(stats["kl"], math.e - 2)
    # β = 0 with a ref: the loss ignores it, the stat still reports it
    loss0, stats0 = grpo_loss(logp, None, torch.zeros(2, 3), ADV, MASK, LossSettings(beta=0.0))
    assert close(loss0, -2.25) and close(stats0["kl"], math.e - 2)


def test_truncated_is_weight_by_hand():
    # weight = min(π_old / π_sampler, cap), cap 3:
    # old 0.5, sampler 0.25 -> 2        old 0.9, sampler 0.1 -> 9, capped at 3
    # old = sampler         -> 1        old 0.2, sampler 0.4 -> 0.5 (never raised: the cap is an upper bound)
    old = torch.tensor([[0.5, 0.9, 0.3, 0.2]], dtype=torch.float64).log()
    sampler = torch.tensor([[0.25, 0.1, 0.3, 0.4]], dtype=torch.float64).log()
    assert close(truncated_is_weight(old, sampler, 3.0), [[2.0, 3.0, 1.0, 0.5]], tol=1e-12)
    # a token the sampler all but never draws: exp(1e4) is inf in float32, and capped all the same
    assert truncated_is_weight(torch.zeros(1, 1), torch.full((1, 1), -1e4), 2.0).item() == 2.0
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weight(old, sampler, 0.0)


def test_is_weight_scales_the_clipped_term_not_the_kl():
    # ρ = 1 (old = logp), A = 2 on each of 2 tokens, weights [0.5, 3]:
    #   clipped terms 2·0.5 = 1 and 2·3 = 6; grpo mean (1 + 6) / 2 = 3.5 -> loss -3.5
    # with β 0.1 and logp -1, ref 0 (k3 = e - 2 per token, unweighted): 3.5 - 0.1·(e - 2)
    logp = torch.full((1, 2), -1.0, requires_grad=True)
    weight = torch.tensor([[0.5, 3.0]])
    loss, _ = grpo_loss(logp, None, None, torch.tensor([2.0]), torch.ones(1, 2), LossSettings(beta=0.0),
                        is_weight=weight)
    assert close(loss, -3.5)
    loss.backward()  # ∂/∂logp_t = -ρ·A·w_t / 2: -0.5 and -3
    assert close(logp.grad, [[-0.5, -3.0]])
    loss_kl, _ = grpo_loss(logp, None, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2),
                           LossSettings(beta=0.1), is_weight=weight)
    assert close(loss_kl, -(3.5 - 0.1 * (math.e - 2)))
    # a weight on a masked position reaches nothing, even inf
    masked, _ = grpo_loss(logp, None, None, torch.tensor([2.0]), torch.tensor([[1, 0]]), LossSettings(beta=0.0),
                          is_weight=torch.tensor([[0.5, math.inf]]))
    assert close(masked, -1.0)


def test_loss_fn_logs_the_sampler_gap_and_corrects_with_a_cap():
    # trainer old log-probs [-1, -2], sampler's [-1.5, -2]: gap (0.5 + 0) / 2 = 0.25
    # cap 1.5: weights min(e^0.5 = 1.6487, 1.5) = 1.5 and e^0 = 1 -> mean 1.25
    # ρ = 1, A = 1: grpo loss -(1.5 + 1) / 2 = -1.25 (one sequence of one: micro-batch weight 1)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    plain = GRPOLoss(LossSettings(0.0, 0.2, None, "k3", "grpo")).for_batch(1, mask.sum(), 2)
    loss, stats = plain(logp, None, None, torch.tensor([1.0]), mask, sampling_logp=sampler)
    assert close(loss, -1.0) and close(stats["sampler/logp_gap"], 0.25)
    assert "sampler/is_weight_mean" not in stats
    capped = GRPOLoss(LossSettings(0.0, 0.2, None, "k3", "grpo", is_correction_cap=1.5)).for_batch(1, mask.sum(), 2)
    loss, stats = capped(logp, logp.detach(), None, torch.tensor([1.0]), mask, sampling_logp=sampler)
    assert close(loss, -1.25) and close(stats["sampler/is_weight_mean"], 1.25)
    # without sampler log-probs (HF generate) the cap has nothing to correct
    loss, stats = capped(logp, None, None, torch.tensor([1.0]), mask)
    assert close(loss, -1.0) and "sampler/logp_gap" not in stats


def test_stat_names_are_the_keys_loss_fn_returns():
    # the update declares the statistics it logs before any row is scored (a rank with no row logs every key)
    logp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    for loss in (GRPOLoss(LossSettings(0.04, 0.2, None, "k3", "grpo")),
                 GRPOLoss(LossSettings(0.0, 0.2, None, "k3", "grpo", is_correction_cap=1.5))):
        fn = loss.for_batch(1, mask.sum(), 2)
        for sampling in (None, logp - 0.5):
            _, stats = fn(logp, logp, logp, torch.tensor([1.0]), mask, sampling_logp=sampling)
            assert list(stats) == loss.stat_names(with_sampling_logp=sampling is not None)


def test_outcome_advantages_broadcast_and_bool_mask():
    # [N] advantages broadcast over T; bool mask same as int mask
    logp = torch.zeros(2, 3)
    a = grpo_loss(logp, None, None, torch.tensor([1.0, -2.0]), MASK.bool(), LossSettings(beta=0.0))[0]
    b = grpo_loss(logp, None, None, torch.tensor([[1.0] * 3, [-2.0] * 3]), MASK.float(), LossSettings(beta=0.0))[0]
    # sequence means 1 and -2 -> (1 - 2) / 2 = -0.5 -> loss 0.5
    assert close(a, 0.5) and close(b, 0.5)


def test_masked_garbage_does_not_leak():
    # pad positions with inf / NaN in logp, old, ref, advantages: loss and gradient stay finite
    logp = torch.tensor([[-1.0, float("inf")], [-2.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")], [-2.0, 0.0]])
    ref = torch.tensor([[-1.0, float("nan")], [-2.0, float("inf")]])
    adv = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        logp.grad = None
        loss, stats = grpo_loss(logp, old, ref, adv, mask, LossSettings(beta=0.04, loss_type=loss_type))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(v) for v in stats.values())


def test_loss_errors():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs ref_logp"):
        grpo_loss(logp, None, None, torch.zeros(1), torch.ones(1, 2), LossSettings(beta=0.04))
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(logp, None, None, torch.zeros(1), torch.ones(1, 2), LossSettings(beta=0.0, loss_type="ppo"))
    with pytest.raises(ValueError, match="only used by loss_type='dapo'"):
        grpo_loss(logp, None, None, torch.zeros(1), torch.ones(1, 2), LossSettings(beta=0.0), normalizer=4)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, None, None, torch.zeros(2), torch.ones(1, 2), LossSettings(beta=0.0))
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(logp, None, None, torch.zeros(1), torch.ones(1, 3), LossSettings(beta=0.0))
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo_loss(logp, None, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), LossSettings(kl_estimator="k9"))


def ref_loss(logp, old, ref, adv, mask, beta, el, eh, est, loss_type, lmax, level="token"):
    """Token by token, in plain floats; level "sequence": every token's ratio is its sequence's GSPO ratio."""
    n, t = len(logp), len(logp[0])
    obj = [[0.0] * t for _ in range(n)]
    for i in range(n):
        gaps = [logp[i][j] - old[i][j] for j in range(t) if mask[i][j]]
        s = math.exp(sum(gaps) / len(gaps)) if gaps else 1.0
        for j in range(t):
            if not mask[i][j]:
                continue
            a = adv[i] if not isinstance(adv[i], list) else adv[i][j]
            rho = math.exp(logp[i][j] - old[i][j]) if level == "token" else s
            o = min(rho * a, min(max(rho, 1 - el), 1 + eh) * a)
            d = ref[i][j] - logp[i][j]
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[est]
            obj[i][j] = o - beta * kl
    count = sum(map(sum, mask))
    total = sum(map(sum, obj))
    if loss_type == "grpo":
        return -sum(sum(obj[i]) / max(sum(mask[i]), 1) for i in range(n)) / n
    if loss_type == "dr_grpo":
        return -total / (n * lmax)
    return -total / max(count, 1)


@pytest.mark.parametrize("seed", range(4))
def test_loss_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 3, 5
    logp = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.5
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[0] = False                                     # an empty sequence
    shape = (n,) if seed % 2 else (n, t)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for est in ("k1", "k2", "k3"):
            fast, _ = grpo_loss(logp, old, ref, adv, mask,
                                LossSettings(beta=0.1, epsilon_high=0.3, kl_estimator=est, loss_type=loss_type),
                                max_completion_length=7)
            slow = ref_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                            0.1, 0.2, 0.3, est, loss_type, 7)
            assert close(fast, slow, tol=1e-10), (loss_type, est)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert close(masked_mean(x, m), 1.5)                 # (1 + 2) / 2
    assert close(masked_mean(x, m, dim=1), [1.5, 0.0])   # an empty row -> 0
    assert close(masked_mean(x, torch.zeros(2, 3)), 0.0)


# --------------------------------------------------------------------------- GSPO: the sequence-level ratio


def gspo_pair():
    """Two sequences of 2 tokens and a pad (inf: must reach nothing); token ratios [2, 0.5] and [4, 1]."""
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([[2.0, 0.5, 1.0], [4.0, 1.0, 1.0]], dtype=torch.float64).log()
    logp[:, 2] = math.inf
    return logp.requires_grad_(), old, torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_gspo_ratio_and_clip_by_hand():
    # s_0 = exp((ln 2 + ln 0.5) / 2) = exp(0) = 1;  s_1 = exp((ln 4 + ln 1) / 2) = exp(ln 2) = 2
    logp, old, mask = gspo_pair()
    assert close(importance_ratio(logp, old, mask, "sequence")[:, :2], [[1, 1], [2, 2]], tol=1e-12)
    # A = 1 on both, ε 0.2: s_0 = 1 lies in [0.8, 1.2] -> 1·1 = 1; s_1 = 2 is clipped -> min(2, 1.2) = 1.2
    # grpo: (1 + 1.2) / 2 = 1.1 -> loss -1.1
    # (token level would clip token 0 of sequence 0 instead: (min(2, 1.2) + 0.5) / 2 = 0.85 and
    #  (min(4, 1.2) + 1) / 2 = 1.1 -> -(0.85 + 1.1) / 2 = -0.975)
    adv = torch.tensor([1.0, 1.0])
    loss, stats = grpo_loss(logp, old, None, adv, mask, LossSettings(beta=0.0, importance_sampling_level="sequence"))
    assert close(loss, -1.1, tol=1e-12)
    assert close(grpo_loss(logp, old, None, adv, mask, LossSettings(beta=0.0))[0], -0.975, tol=1e-12)
    # sequence 1 is clipped with both its tokens, sequence 0 with none: 2 of 4 tokens
    assert close(stats["clip_ratio/high_mean"], 0.5, tol=1e-12) and close(stats["clip_ratio/low_mean"], 0.0, tol=0)
    assert close(stats["ratio_mean"], 1.5, tol=1e-12)   # (1 + 1 + 2 + 2) / 4
    loss.backward()
    # sequence 0: ∂/∂logp_t = -(1/N)(1/|o|)·s_0·A = -(1/2)(1/2)·1·1 = -0.25; sequence 1 clipped: 0
    assert close(logp.grad, [[-0.25, -0.25, 0], [0, 0, 0]], tol=1e-12)
    # A = -1: s_1 = 2 is on the pessimistic side, min(-2, -1.2) = -2: not clipped
    # (-1 + -2) / 2 = -1.5 -> loss 1.5; sequence 1: -(1/2)(1/2)·2·(-1) = 0.5 per token
    logp.grad = None
    loss, stats = grpo_loss(logp, old, None, -adv, mask, LossSettings(beta=0.0, importance_sampling_level="sequence"))
    loss.backward()
    assert close(loss, 1.5, tol=1e-12) and close(stats["clip_ratio/region_mean"], 0.0, tol=0)
    assert close(logp.grad, [[0.25, 0.25, 0], [0.5, 0.5, 0]], tol=1e-12)


def test_gspo_ratio_value_is_exact_and_the_papers_clip_range():
    # float32 log-probs near -20, token log-ratios [2e-4, 0] and [1e-3, 0] (what float32 makes of them):
    # log s = 1e-4 -> s = 1.0001, inside [1 - 3e-4, 1 + 4e-4]; log s = 5e-4 -> s = 1.0005 > 1.0004: clipped
    old = torch.tensor([[-20.0, -19.0], [-20.0, -21.0]])
    logp = (old + torch.tensor([[2e-4, 0.0], [1e-3, 0.0]])).requires_grad_()
    mask = torch.ones(2, 2)
    ratio = importance_ratio(logp, old, mask, "sequence")
    # every token carries exactly s_i, whatever its own log-prob: exp(log s + (lp - lp)), not exp(log s + lp - lp)
    assert torch.equal(ratio.detach(), torch.exp((logp - old).detach().mean(1, keepdim=True)).expand(2, 2))
    assert close(ratio[:, 0], [1.0001, 1.0005], tol=2e-6)
    _, stats = grpo_loss(logp, old, None, torch.tensor([1.0, 1.0]), mask,
                         LossSettings(beta=0.0, epsilon_low=GSPO_EPSILON_LOW, epsilon_high=GSPO_EPSILON_HIGH,
                                      importance_sampling_level="sequence"))
    assert (GSPO_EPSILON_LOW, GSPO_EPSILON_HIGH) == (3e-4, 4e-4)
    assert close(stats["clip_ratio/high_mean"], 0.5, tol=0)   # sequence 1's 2 tokens of 4


def test_gspo_on_policy_is_the_token_level_gradient():
    # old = logp (num_iterations 1): s = 1 in value, ∂ρ_t/∂logp_t = 1 -> the same loss and gradient as token level
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    adv, mask = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.tensor([[1, 1, 1, 0]] * 3)
    grads = []
    for level in ("token", "sequence"):
        logp.grad = None
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, importance_sampling_level=level))[0].backward()
        grads.append(logp.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-15)


def aggregate(objective, keep, loss_type, lmax):
    """The four aggregations of [N, T] per-token objectives (0 where not kept), written out again."""
    m = keep.to(objective.dtype)
    if loss_type == "grpo":
        return (objective.sum(1) / m.sum(1).clamp(min=1)).mean()
    if loss_type == "dr_grpo":
        return objective.sum() / (objective.shape[0] * lmax)
    return objective.sum() / m.sum().clamp(min=1)


def gspo_sequence_form(logp, old, adv, mask, el, eh, loss_type, lmax):
    """GSPO's objective as the paper writes it: s_i with its gradient through the mean of the log-ratios,
    one clipped term per sequence (outcome advantages [N]), spread over the sequence's tokens to aggregate."""
    keep = mask.bool()
    s = torch.exp(torch.where(keep, logp - old, 0.0).sum(1) / keep.sum(1).clamp(min=1))   # [N]
    per_sequence = torch.minimum(s * adv, s.clamp(1 - el, 1 + eh) * adv)                   # [N]
    return -aggregate(per_sequence[:, None] * keep, keep, loss_type, lmax)


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_gspo_token_form_gradient_equals_the_sequence_form(loss_type):
    g = torch.Generator().manual_seed(3)
    n, t = 6, 5
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    logp = (old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[0] = False                                          # an empty sequence
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ours, _ = grpo_loss(logp, old, None, adv, mask,
                        LossSettings(beta=0.0, epsilon_high=0.3, loss_type=loss_type,
                                     importance_sampling_level="sequence"),
                        max_completion_length=7)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    paper = gspo_sequence_form(logp, old, adv, mask, 0.2, 0.3, loss_type, 7)
    (grad_paper,) = torch.autograd.grad(paper, logp)
    assert close(ours, paper, tol=1e-12)
    assert torch.allclose(grad_ours, grad_paper, atol=1e-12)
    # the data reach both sides of the clip: some sequences clipped (zero gradient), some not
    s = importance_ratio(logp, old, mask, "sequence")[:, 0]
    clipped = ((adv > 0) & (s > 1.3)) | ((adv < 0) & (s < 0.8))
    assert clipped.any() and (~clipped & mask.any(1)).any()
    assert (grad_ours[clipped] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_sequence_level_matches_loop(seed):
    # per-token (process) advantages too: the GSPO-token form takes them
    g = torch.Generator().manual_seed(seed)
    n, t = 3, 5
    logp = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3 - 1
    old = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.5
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[0] = False
    adv = torch.randn(*((n,) if seed % 2 else (n, t)), generator=g, dtype=torch.float64)
    for loss_type in CLIPPED:
        fast, _ = grpo_loss(logp, old, ref, adv, mask,
                            LossSettings(beta=0.1, epsilon_high=0.3, loss_type=loss_type,
                                         importance_sampling_level="sequence"),
                            max_completion_length=7)
        slow = ref_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                        0.1, 0.2, 0.3, "k3", loss_type, 7, level="sequence")
        assert close(fast, slow, tol=1e-10), loss_type


def test_importance_sampling_level_errors():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(torch.zeros(1, 2), None, None, torch.zeros(1), torch.ones(1, 2),
                  LossSettings(beta=0.0, importance_sampling_level="sentence"))


# --------------------------------------------------------------------------- sequence-level IS correction


def test_sequence_truncate_by_hand():
    # cap 2: sequence ratios 1.5·1.2 = 1.8 (kept: per token it would be 1.5 and 1.2), 2.5·1.5 = 3.75 -> 2,
    # 0.5 and 0.25 (never raised); each on every token of its sequence, 0 on pads
    old, sampler, mask = sampler_batch()
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="sequence_truncate")
    assert close(w.weight, [[1.8, 1.8, 0], [2, 2, 0], [0.5, 0, 0], [0.25, 0, 0]], tol=1e-12)
    # truncated: sequence 1's 2 tokens of the 6 counted -> 1/3; nothing masked
    assert close(w.truncated_share, 1 / 3, tol=1e-12) and close(w.masked_share, 0.0, tol=0)
    assert not w.weight.requires_grad


def test_sequence_mask_by_hand():
    # cap 2, band [0.5, 2]: 1.8 kept with its ratio as weight; 3.75 above -> 0; 0.5 on the lower edge -> kept, 0.5;
    # 0.25 below -> 0 (truncation leaves a low ratio alone; the mask drops it)
    old, sampler, mask = sampler_batch()
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="sequence_mask")
    assert close(w.weight, [[1.8, 1.8, 0], [0, 0, 0], [0.5, 0, 0], [0, 0, 0]], tol=1e-12)
    # masked: sequences 1 (2 tokens) and 3 (1 token) of 6 tokens -> 3/6 = 0.5; nothing truncated
    assert close(w.masked_share, 0.5, tol=1e-12) and close(w.truncated_share, 0.0, tol=0)


def test_token_truncate_is_truncated_is_weight():
    # per token, cap 2: [1.5, 1.2], [min(2.5, 2) = 2, 1.5], [0.5], [0.25]; 1 of 6 tokens truncated
    old, sampler, mask = sampler_batch()
    w = is_correction_weights(old, sampler, mask, cap=2.0)
    assert close(w.weight, [[1.5, 1.2, 0], [2, 1.5, 0], [0.5, 0, 0], [0.25, 0, 0]], tol=1e-12)
    assert torch.equal(w.weight[mask.bool()], truncated_is_weight(old, sampler, 2.0)[mask.bool()])
    assert close(w.truncated_share, 1 / 6, tol=1e-12) and close(w.masked_share, 0.0, tol=0)


def test_sequence_weights_of_a_sequence_the_sampler_all_but_never_draws():
    # Σ d = 2e4: exp overflows float32 to inf; truncated to the cap, or masked
    old, sampler, mask = torch.zeros(1, 2), torch.full((1, 2), -1e4), torch.ones(1, 2)
    truncated = is_correction_weights(old, sampler, mask, cap=3.0, mode="sequence_truncate")
    assert torch.equal(truncated.weight, torch.full((1, 2), 3.0)) and truncated.truncated_share == 1
    masked = is_correction_weights(old, sampler, mask, cap=3.0, mode="sequence_mask")
    assert torch.equal(masked.weight, torch.zeros(1, 2)) and masked.masked_share == 1


def test_is_correction_errors():
    old, sampler, mask = sampler_batch()
    with pytest.raises(ValueError, match="is_correction"):
        is_correction_weights(old, sampler, mask, cap=2.0, mode="sequence_clip")
    with pytest.raises(ValueError, match="cap"):
        is_correction_weights(old, sampler, mask, cap=0.0, mode="sequence_truncate")
    with pytest.raises(ValueError, match=r"\[1/cap, cap\]"):
        is_correction_weights(old, sampler, mask, cap=0.5, mode="sequence_mask")


def test_loss_fn_with_sequence_is_corrections():
    # trainer's old log-probs [-1, -2] and [-1, -2], the sampler's [-1.5, -2.2] and [-1.1, -1.9]:
    # d = [0.5, 0.2] (Σ 0.7: ratio e^0.7 = 2.01375) and [0.1, -0.1] (Σ 0: ratio 1). ρ = 1, A = 1, cap 1.5
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.2], [-1.1, -1.9]])
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, 1.0])

    def loss_fn(mode):
        loss = GRPOLoss(LossSettings(0.0, 0.2, None, "k3", "grpo", is_correction_cap=1.5, is_correction=mode))
        return loss.for_batch(2, mask.sum(), 2)(logp, None, None, adv, mask, sampling_logp=sampler)

    # sequence_truncate: weights 1.5 and 1 -> grpo -(1.5 + 1) / 2 = -1.25; 2 of 4 tokens truncated
    loss, stats = loss_fn("sequence_truncate")
    assert close(loss, -1.25) and close(stats["sampler/is_weight_mean"], 1.25)
    assert close(stats["sampler/is_truncated_share"], 0.5) and close(stats["sampler/is_masked_share"], 0.0)
    # sequence_mask, band [1/1.5, 1.5]: 2.01375 is outside -> 0; 1 -> 1: -(0 + 1) / 2 = -0.5; 2 of 4 masked
    loss, stats = loss_fn("sequence_mask")
    assert close(loss, -0.5) and close(stats["sampler/is_weight_mean"], 0.5)
    assert close(stats["sampler/is_masked_share"], 0.5) and close(stats["sampler/is_truncated_share"], 0.0)
    # token_truncate (the default): min(e^0.5, 1.5) = 1.5, e^0.2 = 1.22140, e^0.1 = 1.10517, e^-0.1 = 0.90484
    # -> -(1.5 + 1.22140 + 1.10517 + 0.90484) / 4 = -1.18285; 1 of 4 truncated
    loss, stats = loss_fn("token_truncate")
    assert close(loss, -1.18285) and close(stats["sampler/is_truncated_share"], 0.25)


# --------------------------------------------------------------------------- entropy: bonus and top-entropy mask


def test_entropy_mask_by_hand():
    # unmasked entropies 0.1 .. 0.6 (6 of them); the pads hold the largest values (99, inf) and must not count
    entropy = torch.tensor([[0.1, 0.2, 0.3, 99.0], [0.4, 0.5, 0.6, math.inf]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    # q 0.5: the 0.5 quantile sits at position 0.5·(6-1) = 2.5, between 0.3 and 0.4 -> 0.35: keep 0.4, 0.5, 0.6
    assert close(high_entropy_threshold(entropy, mask, 0.5), 0.35, tol=1e-12)
    assert entropy_mask(entropy, mask, 0.5).tolist() == [[False] * 4, [True, True, True, False]]
    # q 0.2: the 0.8 quantile at position 0.8·5 = 4 is 0.5 itself: "at or above" keeps 0.5 and 0.6
    assert entropy_mask(entropy, mask, 0.2).tolist() == [[False] * 4, [False, True, True, False]]
    # q 1: every unmasked token, whatever its entropy (NaN too); never a pad
    entropy[0, 0] = math.nan
    assert torch.equal(entropy_mask(entropy, mask, 1.0), mask.bool())
    # a threshold from elsewhere (the whole batch) replaces this call's quantile
    assert entropy_mask(entropy, mask, 0.5, threshold=0.55).tolist() == [[False] * 4, [False, False, True, False]]


def test_entropy_mask_ties_and_empty():
    # [0.1, 0.5, 0.5, 0.9], q 0.5: position 0.5·3 = 1.5 between 0.5 and 0.5 -> 0.5; both ties kept: 3 of 4 > half
    entropy = torch.tensor([[0.1, 0.5, 0.5, 0.9]])
    assert entropy_mask(entropy, torch.ones(1, 4), 0.5).tolist() == [[False, True, True, True]]
    # all equal: the threshold is that value and every token is kept, whatever q
    assert entropy_mask(torch.ones(2, 2), torch.ones(2, 2), 0.25).all()
    # nothing counted: NaN threshold, nothing kept, no error; an empty batch too
    assert torch.isnan(high_entropy_threshold(entropy, torch.zeros(1, 4), 0.5))
    assert not entropy_mask(entropy, torch.zeros(1, 4), 0.5).any()
    assert entropy_mask(torch.zeros(0, 3), torch.zeros(0, 3), 0.5).shape == (0, 3)


@pytest.mark.parametrize("seed", range(4))
def test_high_entropy_threshold_is_torch_quantile(seed):
    # the sort-based quantile equals torch.quantile (linear interpolation) of the unmasked values
    g = torch.Generator().manual_seed(seed)
    entropy, mask = torch.rand(4, 7, generator=g, dtype=torch.float64), torch.rand(4, 7, generator=g) < 0.6
    for q in (0.05, 0.2, 1 / 3, 0.5, 0.8, 1.0):
        assert close(high_entropy_threshold(entropy, mask, q), torch.quantile(entropy[mask], 1 - q), tol=1e-12)


def test_top_entropy_quantile_masks_the_policy_gradient_not_the_kl():
    # one sequence of 4 tokens, ρ = 1, A = 1, entropies [0.1, 0.2, 0.3, 0.4], q 0.5: threshold 0.25 (position 1.5)
    # -> tokens 2 and 3 keep ρA = 1, tokens 0 and 1 get 0: grpo mean (0 + 0 + 1 + 1) / 4 = 0.5 -> loss -0.5
    logp = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    q = LossSettings(beta=0.0, top_entropy_quantile=0.5)
    loss, stats = grpo_loss(logp, None, None, torch.tensor([1.0]), torch.ones(1, 4), q, entropy=entropy)
    assert close(loss, -0.5, tol=1e-12) and close(stats["entropy_mask/kept_mean"], 0.5, tol=0)
    # a pad with the highest entropy changes neither: kept 2 of the 4 counted tokens, not 2 of 5
    padded, stats = grpo_loss(torch.full((1, 5), -1.0), None, None, torch.tensor([1.0]),
                              torch.tensor([[1, 1, 1, 1, 0]]), LossSettings(beta=0.0, top_entropy_quantile=0.5),
                              entropy=torch.tensor([[0.1, 0.2, 0.3, 0.4, 9.0]]))
    assert close(padded, -0.5) and close(stats["entropy_mask/kept_mean"], 0.5, tol=0)
    # β 0.1, ref 0: k3 = e - 2 on all 4 tokens, masked or not -> -(0.5 - 0.1·(e - 2))
    loss, _ = grpo_loss(logp, None, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4),
                        dataclasses.replace(q, beta=0.1), entropy=entropy)
    assert close(loss, -(0.5 - 0.1 * (math.e - 2)), tol=1e-12)
    loss.backward()
    # ∂k3/∂logp = 1 - exp(ref - logp) = 1 - e -> 0.1·(1 - e)/4 = -0.042957 on every token; -ρA/4 = -0.25 on tokens 2, 3
    kl = 0.1 * (1 - math.e) / 4
    assert close(logp.grad, [[kl, kl, kl - 0.25, kl - 0.25]], tol=1e-12)
    # q 1 (the default) is the plain loss: mean of ρA = 1
    assert close(grpo_loss(logp, None, None, torch.tensor([1.0]), torch.ones(1, 4),
                           LossSettings(beta=0.0, top_entropy_quantile=1.0), entropy=entropy)[0], -1.0, tol=1e-12)


def test_entropy_bonus_sign_and_aggregation():
    # ρ = 1, A = 0, β = 0: the loss is the bonus alone, -coef · aggregate(H). Ragged: [1, 2 | pad] and [4 | pads]
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, math.inf], [4.0, math.nan, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def bonus(loss_type):
        return grpo_loss(logp, None, None, torch.zeros(2), mask,
                         LossSettings(beta=0.0, loss_type=loss_type, entropy_coef=0.01), entropy=entropy)[0]

    # grpo: sequence means (1 + 2) / 2 = 1.5 and 4 -> (1.5 + 4) / 2 = 2.75 -> loss -0.01·2.75 = -0.0275
    loss = bonus("grpo")
    assert close(loss, -0.0275, tol=1e-9)
    loss.backward()
    # ∂loss/∂H = -coef/(N·|o_i|): -0.01/4 = -0.0025 in sequence 0, -0.01/2 = -0.005 in sequence 1; negative:
    # a descent step raises the entropy. Pads get 0
    assert close(entropy.grad, [[-0.0025, -0.0025, 0], [-0.005, 0, 0]], tol=1e-9)
    # bnpo: (1 + 2 + 4) / 3 = 2.33333 -> -0.0233333; dr_grpo (T = 3): 7 / (2·3) -> -0.0116667
    assert close(bonus("bnpo"), -0.01 * 7 / 3, tol=1e-9) and close(bonus("dr_grpo"), -0.01 * 7 / 6, tol=1e-9)


def test_entropy_errors():
    logp, adv, mask = torch.zeros(1, 2, requires_grad=True), torch.zeros(1), torch.ones(1, 2)
    with pytest.raises(ValueError, match="pass entropy"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, entropy_coef=0.01))
    with pytest.raises(ValueError, match="pass entropy"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, top_entropy_quantile=0.0),
                  entropy=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="entropy has shape"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, entropy_coef=0.01), entropy=torch.zeros(1, 3))
    # a detached entropy would add a constant: the bonus would do nothing
    with pytest.raises(ValueError, match="needs an entropy with a gradient"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0, entropy_coef=0.01), entropy=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="only read when top_entropy_quantile < 1"):
        grpo_loss(logp, None, None, adv, mask, LossSettings(beta=0.0), entropy_threshold=0.5)


@pytest.mark.parametrize("kw", [{}, {"is_correction_cap": 2.0}, {"top_entropy_quantile": 0.2},
                                {"top_entropy_quantile": 0.2, "entropy_coef": 0.01, "is_correction_cap": 2.0,
                                 "is_correction": "sequence_mask", "importance_sampling_level": "sequence"}])
@pytest.mark.parametrize("sampler", [False, True])
def test_stat_names_cover_every_option(kw, sampler):
    # the update logs exactly stat_names (a rank with no row too): every configuration's keys, in order
    loss = GRPOLoss(LossSettings(0.04, 0.2, None, "k3", "grpo", **kw))
    batch = random_batch(0, sampler=sampler)
    batch["entropy"] = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    _, stats = loss.for_batch(5, batch["mask"].sum(), 4)(**batch)
    assert list(stats) == loss.stat_names(with_sampling_logp=sampler)
    assert loss.needs_entropy == ("top_entropy_quantile" in kw)


# --------------------------------------------------------------------------- micro-batches add up to the batch


def random_batch(seed, n=5, t=4, sampler=False, entropy=False):
    """A ragged float64 batch: logp (a leaf), old, ref, outcome advantages, mask with an empty row; with
    `sampler` the rollout engine's log-probs, with `entropy` entropies (a leaf, for the bonus)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    batch = {
        "logp": (old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3).requires_grad_(),
        "old_logp": old,
        "ref_logp": old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.5,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "mask": torch.cat([torch.zeros(1, t, dtype=torch.bool), torch.rand(n - 1, t, generator=g) < 0.8]),
    }
    if sampler:
        batch["sampling_logp"] = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.4
    if entropy:
        batch["entropy"] = (torch.rand(n, t, generator=g, dtype=torch.float64) * 2).requires_grad_()
    return batch


def batch_and_micro_batches(loss, batch, rows=(range(0, 2), range(2, 5)), **bound):
    """(loss, gradient) of the whole batch in one call, and summed over micro-batches of `rows`; the
    gradient w.r.t. logp, and the entropy's concatenated to it when it has one."""
    logp, mask = batch["logp"], batch["mask"]
    leaves = [v for v in batch.values() if v.requires_grad]
    fn = loss.for_batch(mask.shape[0], mask.sum().to(logp.dtype), mask.shape[1], **bound)
    full = fn(**batch)[0]
    grad_full = torch.cat(torch.autograd.grad(full, leaves, allow_unused=True, materialize_grads=True))
    parts = sum(fn(**{k: v[list(r)] for k, v in batch.items()})[0] for r in rows)
    grad_parts = torch.cat(torch.autograd.grad(parts, leaves, allow_unused=True, materialize_grads=True))
    return full, grad_full, parts, grad_parts


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_micro_batches_add_up_at_sequence_level(loss_type):
    # GSPO's s_i is a function of row i alone: rows 0-1 and 2-4, each weighted by its aggregation's micro_batch_weight,
    # give the batch's loss and gradient
    loss = GRPOLoss(LossSettings(0.1, 0.2, 0.3, "k3", loss_type, importance_sampling_level="sequence"))
    full, grad_full, parts, grad_parts = batch_and_micro_batches(loss, random_batch(1))
    assert close(full, parts, tol=1e-12)
    assert torch.allclose(grad_full, grad_parts, atol=1e-12) and grad_full.abs().sum() > 0


@pytest.mark.parametrize("loss_type", CLIPPED)
@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_micro_batches_add_up_with_sequence_is_weights(loss_type, mode):
    # a sequence's IS weight is a function of its row alone, and a dropped sequence still counts in the
    # denominators: the batch's loss and gradient, with GSPO on top
    loss = GRPOLoss(LossSettings(0.1, 0.2, 0.3, "k3", loss_type, is_correction_cap=1.5, is_correction=mode,
                                 importance_sampling_level="sequence"))
    batch = random_batch(2, sampler=True)
    w = is_correction_weights(batch["old_logp"], batch["sampling_logp"], batch["mask"], cap=1.5, mode=mode)
    assert (w.truncated_share if mode == "sequence_truncate" else w.masked_share) > 0   # the cap acts
    full, grad_full, parts, grad_parts = batch_and_micro_batches(loss, batch)
    assert close(full, parts, tol=1e-12)
    assert torch.allclose(grad_full, grad_parts, atol=1e-12) and grad_full.abs().sum() > 0


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_micro_batches_add_up_with_the_entropy_bonus_and_a_batch_threshold(loss_type):
    # the bonus is aggregated like the rest; the top-entropy mask adds up only with the batch's threshold
    # micro-batches of rows 0-3 and 4: with its own quantile each would keep other tokens than the batch
    # (row, token) (1, 1), (1, 2) and (4, 0) against the batch's (1, 1), (4, 0), (4, 2)
    loss = GRPOLoss(LossSettings(0.1, 0.2, 0.3, "k3", loss_type, entropy_coef=0.01, top_entropy_quantile=0.3))
    batch, rows = random_batch(3, entropy=True), (range(0, 4), range(4, 5))
    threshold = high_entropy_threshold(batch["entropy"], batch["mask"], 0.3)
    full, grad_full, parts, grad_parts = batch_and_micro_batches(loss, batch, rows, entropy_threshold=threshold)
    assert close(full, parts, tol=1e-12)
    assert torch.allclose(grad_full, grad_parts, atol=1e-12) and grad_full.abs().sum() > 0
    # each call's own quantile (TRL's choice): not the batch loss
    full, _, parts, _ = batch_and_micro_batches(loss, batch, rows)
    assert not close(full, parts, tol=1e-6)
