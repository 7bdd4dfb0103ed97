"""No per-row host syncs in a step's hot loop (#12): on a GPU, the number of device->host syncs of
advantages + prepare + update must not grow with the number of rows. Runs under `pytest -m cuda`
(scripts/gpu_check.sh); skips without a GPU."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from grpo_cli import credit, update
from grpo_cli.objective import GRPOLoss, LossSettings
from grpo_cli.policy import apply_lora, load_tiny_random
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _syncs(rows: int, process: bool) -> Counter:
    """Synchronizing calls torch reports (set_sync_debug_mode 'warn') for one step of `rows` rows, by the
    file:line that made each."""
    device = torch.device("cuda")
    model, tokenizer = load_tiny_random()
    policy = apply_lora(model.to(device), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (rows, 6), generator=g)
    completion = torch.randint(3, 60, (rows, 8), generator=g)
    rollout = Rollout(ids.to(device), torch.ones_like(ids).to(device), completion.to(device),
                      torch.ones_like(completion).to(device), ["a b\nc d"] * rows, [False] * rows)
    rewards = torch.randint(0, 2, (rows,), generator=g).float().tolist()
    result = (RewardResult(rewards=rewards, per_function={}, steps=[[(3, r), (7, 1.0)] for r in rewards]) if process
              else RewardResult(rewards=rewards, per_function={}))
    loss = GRPOLoss(LossSettings(beta=0.04, epsilon_low=0.2, epsilon_high=None, kl_estimator="k3", loss_type="grpo"))
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            adv = credit.advantages(credit.token_rewards(result, rollout, tokenizer), 4, "group", "population")
            batch = update.prepare(policy, rollout, adv, loss, 2, 4, False)
            update.update(policy, optimizer, scheduler, batch, max_grad_norm=1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


@pytest.mark.parametrize("process", [False, True], ids=["outcome", "process"])
def test_host_syncs_do_not_grow_with_rows(process):
    # 8 and 32 rows, micro-batches of 4: 2 and 8 micro-batches per pass; the syncs per step stay the same
    # (per optimizer step: the loss and the gradient norm; per step: the counts and the active rows)
    many, few = _syncs(32, process), _syncs(8, process)
    # on a failure, the sites whose count grew: where a per-row or per-micro-batch sync is
    grew = {site: (few[site], n) for site, n in many.items() if n > few[site]}
    assert many.total() == few.total(), f"syncs {many.total()} vs {few.total()}; grew (8 rows, 32 rows): {grew}"
