"""Fixed batches: the 16-row batch that the 2-rank update tests (distributed, fsdp) split over their ranks, one update
of it, and the importance-sampling batch of the loss tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from grpo_cli import credit, update
from grpo_cli.distributed import World
from grpo_cli.objective import GRPOLoss, LossSettings
from grpo_cli.policy import apply_lora, load_tiny_random
from grpo_cli.rewards import RewardResult
from grpo_cli.rollout import Rollout

G = 4  # completions per prompt
ROWS = 16  # the global batch: 4 groups; 2 ranks hold 8 rows (2 groups) each
MICRO = 3  # ragged micro-batches (3 + 3 + 2 per rank, 3 x 5 + 1 on one rank)
# #24's loss options (GRPOLoss keyword arguments); with them the rollout carries a sampler's own log-probs
OPTIONS = {
    "gspo": {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    "entropy": {"entropy_coef": 0.01, "top_entropy_quantile": 0.5},  # the batch threshold over both ranks
    "seqmask": {"is_correction": "sequence_mask", "is_correction_cap": 3.0},
    "seqtrunc": {"is_correction": "sequence_truncate", "is_correction_cap": 1.5},
}

def _name(case) -> str:
    return "_".join(str(x) for x in case)


def _policy():
    model, tokenizer = load_tiny_random()
    policy = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # seeded, and B off zero: the policy differs from the reference and A gets a gradient
        g = torch.Generator().manual_seed(1)
        for name, p in sorted(policy.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy, tokenizer


def _batch(kind: str) -> tuple[Rollout, RewardResult]:
    """The global batch: 16 rows of random tokens, completions of 1-7 tokens, rewards per `kind`."""
    g = torch.Generator().manual_seed(0)
    p_len, t_len = 5, 7
    prompt_ids = torch.randint(3, 60, (ROWS, p_len), generator=g)
    prompt_mask = torch.ones(ROWS, p_len, dtype=torch.long)
    prompt_mask[::3, 0] = 0  # some prompts left-padded
    lengths = torch.randint(1, t_len + 1, (ROWS,), generator=g)
    completion_mask = (torch.arange(t_len)[None, :] < lengths[:, None]).long()  # [16, 7]
    completion_ids = torch.where(completion_mask.bool(), torch.randint(3, 60, (ROWS, t_len), generator=g), 0)
    rewards = torch.randint(0, 3, (ROWS,), generator=g).float().tolist()
    if kind == "dead_rank":
        rewards[8:] = [1.0] * 8
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, [""] * ROWS,
                      [bool(n == t_len) for n in lengths.tolist()])
    if kind in OPTIONS:  # a sampler's log-probs near the policy's (tiny random model: about -log 64 a token)
        rollout.sampling_logp = (-4.2 + 0.1 * torch.randn(ROWS, t_len, generator=g)) * completion_mask
    return rollout, RewardResult(rewards=rewards, per_function={})


def _local(rollout: Rollout, result: RewardResult, world: World) -> tuple[Rollout, RewardResult]:
    rows = list(range(ROWS))[world.slice(ROWS)]
    return rollout.take(rows), RewardResult(rewards=[result.rewards[i] for i in rows], per_function={})


def _step(case, world: World, fsdp: bool = False) -> tuple[dict, dict]:
    """One `update` of `case` on this rank's share of the batch; (LoRA weights, stats). `fsdp`: the base sharded
    over the ranks first (tests/unit/test_fsdp.py)."""
    loss_type, beta, mu, scale, kind = case
    torch.manual_seed(0)
    policy, tokenizer = _policy()
    if fsdp:
        from grpo_cli import fsdp as sharding

        sharding.shard(policy, world)
    rollout, result = _local(*_batch(kind), world)
    options = {"epsilon_low": 0.2, "epsilon_high": None, **OPTIONS.get(kind, {})}
    loss = GRPOLoss(LossSettings(beta=beta, kl_estimator="k3", loss_type=loss_type, **options))
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    adv = credit.advantages(credit.token_rewards(result, rollout, tokenizer), G, scale, "population", world)
    batch = update.prepare(policy, rollout, adv, loss, mu, MICRO, True, world)
    stats = update.update(policy, optimizer, scheduler, batch, max_grad_norm=1.0).metrics()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    return weights, stats


def _save_step(out: str, case: tuple, rank: int, weights: dict, stats: dict) -> None:
    """One rank's LoRA weights and step statistics for `case`, where the test process reads them."""
    save_file(weights, str(Path(out) / f"{_name(case)}_r{rank}.safetensors"))
    save_file({k: torch.tensor(float(v)) for k, v in stats.items()},
              str(Path(out) / f"{_name(case)}_stats_r{rank}.safetensors"))


def is_correction_batch():
    """π_old / π_sampler per token of 4 sequences for the IS-correction tests, pads NaN on the sampler's side (they
    must reach nothing): [1.5, 1.2] (product 1.8), [2.5, 1.5] (3.75), [0.5], [0.25]; 6 counted tokens.
    Returns (old log-probs, sampler log-probs, mask), each [4, 3]."""
    import math

    old = torch.tensor([[0.6, 0.6, 1], [0.5, 0.3, 1], [0.25, 1, 1], [0.1, 1, 1]], dtype=torch.float64).log()
    sampler = torch.tensor([[0.4, 0.5, 1], [0.2, 0.2, 1], [0.5, 1, 1], [0.4, 1, 1]], dtype=torch.float64).log()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
    return old, sampler.masked_fill(mask == 0, math.nan), mask
