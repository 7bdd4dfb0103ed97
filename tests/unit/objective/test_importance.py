"""objective/importance.py: the sampler's IS weights in the mask modes, each worked by hand, with the band's lower
bound (algo.is_correction_min) beside the cap; and the algo checks that go with them."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.objective import GRPOLoss, LossSettings, is_correction_weights
from tests.helpers.batches import is_correction_batch as batch


def close(x, expected, tol=1e-9):
    return torch.allclose(torch.as_tensor(x, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def test_token_mask_drops_the_tokens_outside_the_band():
    # cap 2, no lower bound given -> band [1/2, 2]: 2.5 above -> 0, 0.25 below -> 0, 0.5 on the edge kept;
    # a kept token's weight is its own ratio (masked IS), not 1
    old, sampler, mask = batch()
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="token_mask")
    assert close(w.weight, [[1.5, 1.2, 0], [0, 1.5, 0], [0.5, 0, 0], [0, 0, 0]])
    # masked: 2 of the 6 counted tokens -> 1/3; nothing truncated
    assert close(w.masked_share, 1 / 3) and close(w.truncated_share, 0.0)
    assert not w.weight.requires_grad


def test_the_lower_bound_sets_the_bands_low_side():
    old, sampler, mask = batch()
    # token_mask, band [0.2, 2]: only 2.5 leaves -> 1 of 6
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="token_mask", low=0.2)
    assert close(w.weight, [[1.5, 1.2, 0], [0, 1.5, 0], [0.5, 0, 0], [0.25, 0, 0]])
    assert close(w.masked_share, 1 / 6)
    # token_mask, band [0.6, 2]: 2.5 and 0.5 and 0.25 leave -> 3 of 6
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="token_mask", low=0.6)
    assert close(w.weight, [[1.5, 1.2, 0], [0, 1.5, 0], [0, 0, 0], [0, 0, 0]]) and close(w.masked_share, 0.5)
    # sequence_mask, band [0.25, 2]: ratios 1.8 kept, 3.75 out, 0.5 kept, 0.25 on the edge kept -> 2 of 6 tokens
    w = is_correction_weights(old, sampler, mask, cap=2.0, mode="sequence_mask", low=0.25)
    assert close(w.weight, [[1.8, 1.8, 0], [0, 0, 0], [0.5, 0, 0], [0.25, 0, 0]]) and close(w.masked_share, 1 / 3)


def test_mask_band_errors():
    old, sampler, mask = batch()
    with pytest.raises(ValueError, match=r"low \(3.0\) must be in \(0, cap\]"):
        is_correction_weights(old, sampler, mask, cap=2.0, mode="token_mask", low=3.0)
    with pytest.raises(ValueError, match="low is read only by the mask modes"):
        is_correction_weights(old, sampler, mask, cap=2.0, mode="token_truncate", low=0.5)


def test_loss_fn_with_token_mask():
    # trainer's old log-probs [-1, -2] twice, the sampler's [-1.5, -2.2] and [-1.1, -1.9]: token ratios
    # e^0.5 = 1.64872, e^0.2 = 1.22140, e^0.1 = 1.10517, e^-0.1 = 0.90484; ρ = 1, A = 1; cap 1.5, band [2/3, 1.5]:
    # the first token leaves -> grpo -((0 + 1.22140) / 2 + (1.10517 + 0.90484) / 2) / 2 = -0.80785; 1 of 4 masked
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], requires_grad=True)
    sampler = torch.tensor([[-1.5, -2.2], [-1.1, -1.9]])
    mask, adv = torch.ones(2, 2), torch.tensor([1.0, 1.0])
    loss_fn = GRPOLoss(LossSettings(0.0, 0.2, None, "k3", "grpo", is_correction_cap=1.5,
                                    is_correction="token_mask")).for_batch(2, mask.sum(), 2)
    loss, stats = loss_fn(logp, None, None, adv, mask, sampling_logp=sampler)
    assert close(loss, -0.80785, tol=1e-5) and close(stats["sampler/is_masked_share"], 0.25, tol=1e-7)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0      # the masked token takes no policy gradient


def errors(*overrides: str) -> list[str]:
    try:
        validate(compose("train", ["sampler=vllm", *overrides]))
    except ConfigError as err:
        return str(err).splitlines()
    return []


def test_token_mask_and_the_lower_bound_compose():
    assert errors("algo.is_correction=token_mask", "algo.is_correction_cap=2", "algo.is_correction_min=0.3") == []


@pytest.mark.parametrize("overrides, line", [
    (["algo.is_correction=token_mask"],
     "algo.is_correction (token_mask) needs a cap: set algo.is_correction_cap (a sequence cap is larger than a "
     "token one, e.g. 5; verl suggests 2-10), or algo.is_correction=token_truncate"),
    (["algo.is_correction=token_mask", "algo.is_correction_cap=2", "algo.is_correction_min=1.5"],
     "algo.is_correction_min (1.5) must be in (0, 1] or null (null: 1/is_correction_cap); "
     "set algo.is_correction_min=null"),
    (["algo.is_correction_cap=2", "algo.is_correction_min=0.5"],
     "algo.is_correction_min (0.5) is read only by algo.is_correction=token_mask or sequence_mask (truncation "
     "lowers the high weights only): set algo.is_correction_min=null, or algo.is_correction=token_mask"),
])
def test_is_correction_settings_that_cannot_work_are_refused(overrides, line):
    assert errors(*overrides) == [line]
