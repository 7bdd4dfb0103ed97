"""The loss types with a per-token term of their own (grpo_cli/objective/surrogate.py): CISPO, SAPO, GMPO, worked by
hand, against plain loops on random ragged batches, and in micro-batches. Their match with TRL's and verl's own code
is scripts/loss_vs_trl.py (docs/algorithm.md)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.objective import AGGREGATIONS, LOSS_TYPES, SURROGATES, GRPOLoss, Loss, LossSettings, grpo_loss

VARIANT = {"cispo_cap": 5.0, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}


def close(x, expected, tol=1e-6):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def with_ratios(ratios, old=-1.0):
    """[N, T] logp (a leaf) and old_logp with exp(logp - old) = ratios."""
    old_logp = torch.full((len(ratios), len(ratios[0])), old, dtype=torch.float64)
    return (old_logp + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(), old_logp


def loss_and_grad(loss_type, ratios, adv, **kw):
    logp, old = with_ratios(ratios)
    loss, stats = grpo_loss(logp, old, None, torch.tensor(adv, dtype=torch.float64), torch.ones_like(old),
                            LossSettings(beta=0.0, loss_type=loss_type, **{**VARIANT, **kw}))
    loss.backward()
    return loss, logp.grad, stats


def test_cispo_by_hand():
    # ρ [0.5, 1, 8], Â [1, -1, 2], cap 5: weights sg[min(ρ, 5)] = [0.5, 1, 5]
    # log π = -1 + ln ρ = [-1.69315, -1, 1.07944]
    # terms w·Â·log π: 0.5·1·-1.69315 = -0.84657; 1·-1·-1 = 1; 5·2·1.07944 = 10.79442; sum 10.94784
    # dapo's aggregation over the 3 tokens: 3.64928 -> loss -3.64928
    loss, grad, stats = loss_and_grad("cispo", [[0.5, 1.0, 8.0]], [[1.0, -1.0, 2.0]])
    assert close(loss, -3.64928, tol=1e-5)
    # ∂loss/∂log π = -w·Â/3: [-0.5/3, 1/3, -10/3]; the capped token keeps its gradient (PPO's clip would zero it)
    assert close(grad, [[-1 / 6, 1 / 3, -10 / 3]], tol=1e-12)
    # the cap bound 1 of 3 tokens; ratio_mean (0.5 + 1 + 8) / 3
    assert close(stats["clip_ratio/high_mean"], 1 / 3, tol=1e-12) and close(stats["clip_ratio/low_mean"], 0.0)
    assert close(stats["ratio_mean"], 9.5 / 3, tol=1e-12)


def test_sapo_by_hand():
    # ρ [1, 1.5, 0.5], Â [1, 1, -1]; τ 1 where Â > 0, 1.05 else; gate 4/τ·σ(τ(ρ - 1)):
    # 4·σ(0) = 2 -> 2·1 = 2;  4·σ(0.5) = 4·0.62246 = 2.48984 -> 2.48984;  4/1.05·σ(-0.525) = 3.80952·0.37168 = 1.41594
    # -> -1.41594; grpo's aggregation (one sequence of 3): (2 + 2.48984 - 1.41594) / 3 = 1.02463 -> loss -1.02463
    loss, grad, stats = loss_and_grad("sapo", [[1.0, 1.5, 0.5]], [[1.0, 1.0, -1.0]])
    assert close(loss, -1.02463, tol=1e-5)
    # ∂/∂log π of gate(ρ)·Â = 4σ(1 - σ)·ρ·Â: 4·0.25·1·1 = 1 (on policy: the policy gradient, whatever τ);
    # 4·0.62246·0.37754·1.5 = 1.41002; 4·0.37168·0.62832·0.5·-1 = -0.46707; the loss's: each · -1/3
    assert close(grad, [[-1 / 3, -0.47001, 0.15569]], tol=1e-5)
    # soft, not clipped: ρ = 1.5 keeps a gradient, and no clip is counted
    assert close(stats["clip_ratio/region_mean"], 0.0)


def test_gmpo_by_hand():
    # sequence 0: Â = 1, log-ratios [0.6, -0.2] clipped above at ε_high 0.4: [0.4, -0.2], mean 0.1, r̃ = e^0.1 = 1.10517
    # sequence 1: Â = -1, log-ratios [-0.6, 0.2] clipped below at -ε_low: [-0.4, 0.2], mean -0.1, r̃ = e^-0.1 = 0.90484
    # mean over the sequences of r̃·Â: (1.10517 - 0.90484) / 2 = 0.10017 -> loss -0.10017
    e = math.exp
    loss, grad, stats = loss_and_grad("gmpo", [[e(0.6), e(-0.2)], [e(-0.6), e(0.2)]], [1.0, -1.0],
                                      epsilon_low=0.4, epsilon_high=0.4)
    assert close(loss, -0.10017, tol=1e-5)
    # the clipped tokens get no gradient; the others ∂(r̃·Â)/∂log π = r̃·Â/|o| = 1.10517/2 and -0.90484/2, over N = 2
    assert close(grad, [[0.0, -0.27629], [0.0, 0.22621]], tol=1e-5)
    # clipped: one token with Â > 0 (high), one with Â < 0 (low), of 4; ratio_mean: r̃ on each token
    assert close(stats["clip_ratio/high_mean"], 0.25) and close(stats["clip_ratio/low_mean"], 0.25)
    assert close(stats["ratio_mean"], (1.10517 + 0.90484) / 2, tol=1e-5)


def test_every_loss_type_has_a_term_and_an_aggregation():
    assert set(SURROGATES) == set(AGGREGATIONS) == set(LOSS_TYPES)
    assert {"cispo", "sapo", "gmpo"} <= set(LOSS_TYPES)


def test_a_variant_needs_its_settings_and_gmpo_token_ratios():
    logp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match=r"loss_type='cispo' reads cispo_cap"):
        grpo_loss(logp, None, None, torch.ones(1), torch.ones(1, 2), LossSettings(beta=0.0, loss_type="cispo"))
    with pytest.raises(ValueError, match=r"sapo_temperature_pos, sapo_temperature_neg"):
        grpo_loss(logp, None, None, torch.ones(1), torch.ones(1, 2), LossSettings(beta=0.0, loss_type="sapo"))
    with pytest.raises(ValueError, match=r"importance_sampling_level='token'"):
        grpo_loss(logp, None, None, torch.ones(1), torch.ones(1, 2),
                  LossSettings(beta=0.0, loss_type="gmpo", importance_sampling_level="sequence"))


# --------------------------------------------------------------------------- plain loops on random ragged batches


def loop_loss(loss_type, logp, old, ref, adv, mask, beta, el, eh):
    """Each variant token by token in plain floats, with the k3 KL, aggregated as its loss_type."""
    n, t = len(logp), len(logp[0])
    obj = [[0.0] * t for _ in range(n)]
    for i in range(n):
        count = sum(mask[i])
        a = [adv[i][j] if isinstance(adv[i], list) else adv[i] for j in range(t)]
        logs = [0.0 if a[j] == 0 else min(logp[i][j] - old[i][j], eh) if a[j] > 0 else max(logp[i][j] - old[i][j], -el)
                for j in range(t) if mask[i][j]]
        geo = math.exp(sum(logs) / count) if count else 1.0
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(logp[i][j] - old[i][j])
            if loss_type == "cispo":
                o = min(rho, VARIANT["cispo_cap"]) * a[j] * logp[i][j]
            elif loss_type == "sapo":
                tau = VARIANT["sapo_temperature_pos"] if a[j] > 0 else VARIANT["sapo_temperature_neg"]
                o = 4 / tau / (1 + math.exp(-tau * (rho - 1))) * a[j]
            else:
                o = geo * a[j]
            d = ref[i][j] - logp[i][j]
            obj[i][j] = o - beta * (math.exp(d) - d - 1)
    if loss_type == "cispo":
        return -sum(map(sum, obj)) / max(sum(map(sum, mask)), 1)
    return -sum(sum(obj[i]) / max(sum(mask[i]), 1) for i in range(n)) / n


def random_batch(seed, n=4, t=5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 1.5
    logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.6
    ref = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.5
    mask = torch.rand(n, t, generator=g) < 0.7
    mask[0] = False                                      # an empty sequence
    adv = torch.randn(*((n,) if seed % 2 else (n, t)), generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gmpo"])
def test_variants_match_the_loop(loss_type, seed):
    logp, old, ref, adv, mask = random_batch(seed)
    # ε 0.3 / 0.25 is GMPO's clip range of the log-ratio; cispo and sapo do not read it
    fast, _ = grpo_loss(logp, old, ref, adv, mask,
                        LossSettings(beta=0.1, epsilon_low=0.3, epsilon_high=0.25, loss_type=loss_type, **VARIANT))
    slow = loop_loss(loss_type, logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.1, 0.3, 0.25)
    assert close(fast, slow, tol=1e-10)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gmpo"])
def test_variant_micro_batches_add_up_to_the_batch(loss_type):
    # rows 0-1 and 2-3, each weighted by its aggregation's micro_batch_weight: the batch's loss and gradient
    logp, old, ref, adv, mask = random_batch(5)
    logp.requires_grad_()
    loss = GRPOLoss(LossSettings(0.1, 0.2, 0.3 if loss_type == "gmpo" else None, "k3", loss_type, **VARIANT))
    fn = loss.for_batch(mask.shape[0], mask.sum().to(logp.dtype), mask.shape[1])
    full = fn(logp, old, ref, adv, mask)[0]
    (grad_full,) = torch.autograd.grad(full, logp)
    parts = sum(fn(logp[r], old[r], ref[r], adv[r], mask[r])[0] for r in (slice(0, 2), slice(2, 4)))
    (grad_parts,) = torch.autograd.grad(parts, logp)
    assert close(full, parts, tol=1e-12) and torch.allclose(grad_full, grad_parts, atol=1e-12)
    assert grad_full.abs().sum() > 0


def test_an_old_runs_loss_still_builds():
    # a run saved before the variants' settings lacks their keys: LossSettings' defaults (None); its loss_type never
    # reads them
    loss = GRPOLoss(LossSettings(0.04, 0.2, None, "k3", "grpo"))
    logp, old, ref, adv, mask = random_batch(0)
    assert torch.isfinite(loss.for_batch(4, mask.sum(), 5)(logp, old, ref, adv, mask)[0])


@pytest.mark.parametrize("settings,declared", [
    # (needs_reference, needs_old_logprobs, needs_entropy, needs_entropy_grad, entropy_quantile)
    (LossSettings(), (True, True, False, False, None)),                       # β 0.04: the reference forward
    (LossSettings(beta=0.0, top_entropy_quantile=0.2), (False, True, True, False, 0.2)),   # the mask reads H
    (LossSettings(beta=0.0, entropy_coef=0.01), (False, True, True, True, None)),         # the bonus differentiates H
])
def test_a_loss_declares_what_it_reads(settings, declared):
    # the update asks these of any loss (objective.Loss), not for the settings of one class
    loss = GRPOLoss(settings)
    assert isinstance(loss, Loss)
    assert (loss.needs_reference, loss.needs_old_logprobs, loss.needs_entropy, loss.needs_entropy_grad,
            loss.entropy_quantile) == declared
