"""`grpo train`: the GRPO loop (DeepSeekMath, arXiv 2402.03300, Algorithm 1), top to bottom.

    grpo train                                   # embedded SmolLM2-135M + LoRA, arithmetic, CPU
    grpo train +recipe=gsm8k data.path=train.jsonl trainer.max_steps=100
    grpo train resume=outputs/train/DATE/TIME    # continue a run from its latest checkpoint

Each step: draw prompts -> G completions each (policy with LoRA on) -> rewards -> group-normalized
advantages (outcome or process) -> μ policy updates on the clipped objective with a k3 KL to the
reference policy (the same model with the adapter off) -> log -> checkpoint.

Departures from the paper: the policy trains a LoRA adapter instead of all weights (so the
reference model costs no memory); the reference policy is the initial model for the whole run (the
paper's iterative variant resets it each RL iteration, which is future work here); one "step" is
one exploration stage followed by μ optimizer steps.
"""

from __future__ import annotations

import math
import random
import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from grpo_cli import checkpoint
from grpo_cli.config import build, hydra_app, validate
from grpo_cli.metrics import (MetricsLog, console, limit_heap_growth, mean, peak_memory_mb, plot_training,
                              progress)
from grpo_cli.objective import grpo_loss, outcome_advantages, process_advantages
from grpo_cli.policy import build_policy
from grpo_cli.rewards import score
from grpo_cli.rollout import Rollout, char_ends_to_token_index, render_prompts, sequence_logprobs


@hydra_app("train")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run(cfg, Path(HydraConfig.get().runtime.output_dir))


def run(cfg: DictConfig, run_dir: Path) -> Path:
    """Train as `cfg` says, writing into `run_dir`; returns the last checkpoint's folder."""
    validate(cfg)
    limit_heap_growth()
    T, A = cfg.trainer, cfg.algo
    torch.manual_seed(T.seed)
    policy, tokenizer, device = build_policy(cfg.model)
    if T.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = build(cfg.data)
    reward_fn = build(cfg.reward)
    sampler = build(cfg.sampler)
    optimizer = build(cfg.optimizer)(params=[p for p in policy.parameters() if p.requires_grad])
    optimizer.zero_grad(set_to_none=False)  # zero (not absent) grads: a step with every row skipped is still a step
    from transformers import get_scheduler

    scheduler = get_scheduler(T.lr_scheduler, optimizer, num_warmup_steps=T.warmup_steps,
                              num_training_steps=T.max_steps * A.num_iterations)
    state = {"step": 0, "data_position": 0, "history": []}
    if cfg.resume:
        ckpt = checkpoint.resolve(cfg.resume)
        checkpoint.load_adapter(policy, ckpt)
        state = checkpoint.load_training_state(ckpt, optimizer, scheduler)
        run_dir = ckpt.parent.parent  # the same run goes on in its own folder: one metrics.jsonl, one checkpoints/
        console.print(f"resumed from {ckpt} at step {state['step']}")
    log = MetricsLog(run_dir, tensorboard=T.tensorboard)
    log.truncate(state["step"])
    stop = _StopFlag()
    last = None
    console.print(f"run dir: {run_dir}")

    with progress("train") as bar:
        task = bar.add_task("train", total=T.max_steps, completed=state["step"], info="")
        for step in range(state["step"] + 1, T.max_steps + 1):
            _seed_step(T.seed, step)  # sampling randomness is a function of (seed, step): exact resume
            t0 = time.perf_counter()

            # 1. prompts: the next prompts_per_step examples of the seeded, resumable stream
            examples, state["data_position"] = draw(data.train, T.seed, state["data_position"], T.prompts_per_step)

            # 2. rollout: G completions per prompt with the current policy (LoRA on)
            rollout = sampler.generate(policy, tokenizer, render_prompts(tokenizer, [e["messages"] for e in examples]),
                                       A.group_size)
            t_rollout = time.perf_counter() - t0

            # 3. score: one reward per completion, or step rewards (process supervision)
            owners = [i for i in range(len(examples)) for _ in range(A.group_size)]
            result = score(reward_fn, examples, owners, rollout.texts, rollout.lengths, rollout.truncated)

            # 4. advantages: normalized within each group of G
            advantages = compute_advantages(result, rollout, tokenizer, A)

            # 5. update: μ passes of the clipped objective with a KL to the reference policy
            t1 = time.perf_counter()
            stats = update(policy, optimizer, scheduler, rollout, advantages, A, T)
            t_update = time.perf_counter() - t1

            # 6. log
            record = {"step": step, **rollout_metrics(result, rollout, A.group_size), **stats,
                      "learning_rate": scheduler.get_last_lr()[0], "time/rollout_s": t_rollout,
                      "time/update_s": t_update, "tokens_per_s": sum(rollout.lengths) / max(t_rollout, 1e-9),
                      "peak_memory_mb": peak_memory_mb(device)}
            log.log(record)
            state["step"] = step
            state["history"].append({k: v for k, v in record.items() if not k.startswith("time/")})
            bar.update(task, completed=step, info=f"reward {record['reward']:.3f}  kl {record['kl']:.4f}  "
                                                  f"loss {record['loss']:+.4f}  len {record['completions/mean_length']:.0f}")

            # 7. checkpoint
            if step % T.save_every == 0 or step == T.max_steps or stop.requested:
                # a record for inspection: resume does not need it, each step reseeds from (seed, step)
                state["rng"] = {"torch": torch.get_rng_state().tolist(), "python": list(random.getstate()[1])}
                last = checkpoint.save(run_dir, step, policy, optimizer, scheduler, state, cfg, T.keep_last)
            if stop.requested:
                console.print(f"stopped by {stop.requested} after step {step}; checkpoint: {last}\n"
                              f"resume with: grpo train resume={run_dir}")
                break
    stop.restore()
    if last is None:  # resumed at or past max_steps: nothing to do
        last = checkpoint.resolve(run_dir)
    console.print(f"checkpoint: {last}\ncurves: {plot_training(run_dir)}")
    return last


def draw(dataset, seed: int, position: int, k: int) -> tuple[list[dict], int]:
    """k examples from a seeded shuffle of `dataset`, reshuffled each epoch; position = examples consumed."""
    n = len(dataset)
    out = []
    for p in range(position, position + k):
        epoch, i = divmod(p, n)
        perm = _permutation(n, seed, epoch)
        out.append(dataset[int(perm[i])])
    return out, position + k


_perm_cache: dict[tuple[int, int, int], torch.Tensor] = {}


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        _perm_cache.clear()
        _perm_cache[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return _perm_cache[key]


def _seed_step(seed: int, step: int) -> None:
    s = (seed * 1_000_003 + step) % 2**63
    random.seed(s)
    torch.manual_seed(s)


def compute_advantages(result, rollout: Rollout, tokenizer, A: DictConfig) -> torch.Tensor:
    """[N] outcome advantages, or [N, T] process advantages from step rewards at their end tokens."""
    if result.steps is None:
        rewards = torch.tensor([math.nan if r is None else r for r in result.rewards], dtype=torch.float32)
        return outcome_advantages(rewards, A.group_size, scale=A.advantage_scale, std=A.advantage_std)
    step_rewards, step_ends = [], []
    for row, steps in enumerate(result.steps):
        ids = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        # several steps may end inside one token; keep the last reward per token so ends stay increasing
        ends = char_ends_to_token_index(tokenizer, ids, [end for end, _ in steps]) if steps else []
        by_token: dict[int, float] = {}
        for t, (_, r) in zip(ends, steps):
            by_token[t] = by_token.get(t, 0.0) + r
        step_ends.append(sorted(by_token))
        step_rewards.append([by_token[t] for t in sorted(by_token)])
    return process_advantages(step_rewards, step_ends, A.group_size, rollout.completion_ids.shape[1])


def update(policy, optimizer, scheduler, rollout: Rollout, advantages: torch.Tensor, A: DictConfig,
           T: DictConfig) -> dict:
    """μ optimizer steps over the rollout in micro-batches; returns the step's loss statistics."""
    device = rollout.completion_ids.device
    advantages = advantages.to(device)
    mask = rollout.completion_mask.float()  # [N, T]; 1 on completion tokens up to EOS
    if A.mask_truncated_completions:
        mask[torch.tensor(rollout.truncated, device=device)] = 0.0
    N = mask.shape[0]

    def batches(rows: list[int]) -> list[list[int]]:
        return [rows[i:i + T.micro_batch_size] for i in range(0, len(rows), T.micro_batch_size)]

    # reference log-probs (adapter off) once per rollout, and only when the KL term is on
    ref_logp = None
    if A.beta > 0:
        with torch.no_grad(), policy.disable_adapter():
            ref_logp = torch.cat([sequence_logprobs(policy, rollout.select(b)) for b in batches(list(range(N)))])
    # rows with zero advantage everywhere carry no gradient when β = 0: skip their forward/backward
    adv_rows = advantages.reshape(N, -1)
    active = list(range(N)) if A.beta > 0 else [i for i in range(N)
                                                if bool(adv_rows[i].ne(0).any() and mask[i].any())]
    # old log-probs: the sampling-time policy; with μ = 1 it is the current one (logp.detach())
    old_logp = None
    if A.num_iterations > 1 and active:
        with torch.no_grad():
            old_logp = torch.zeros_like(mask)
            for b in batches(active):
                old_logp[b] = sequence_logprobs(policy, rollout.select(b))

    totals = {"loss": 0.0, "kl": 0.0, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0,
              "clip_ratio/region_mean": 0.0, "ratio_mean": 0.0, "entropy": 0.0}
    grad_norm = 0.0
    n_tokens = mask.sum().clamp(min=1)
    # token-level statistics (kl, clip ratios, entropy) average over the tokens that were updated
    active_tokens = mask[active].sum().clamp(min=1) if active else n_tokens
    policy.train()
    for _ in range(A.num_iterations):
        for b in batches(active):
            sub, m = rollout.select(b), mask[b]
            logp, entropy = sequence_logprobs(policy, sub, with_entropy=True)
            loss, stats = grpo_loss(logp, old_logp[b] if old_logp is not None else logp.detach(),
                                    ref_logp[b] if ref_logp is not None else None, advantages[b], m,
                                    beta=A.beta, epsilon_low=A.epsilon_low, epsilon_high=A.epsilon_high,
                                    kl_estimator=A.kl_estimator, loss_type=A.loss_type,
                                    max_completion_length=rollout.completion_ids.shape[1],
                                    normalizer=n_tokens if A.loss_type == "dapo" else None)
            # weight so that the accumulated gradient equals the full batch's (skipped rows count as 0)
            weight = accumulation_weight(A.loss_type, len(b), N, m.sum(), n_tokens)
            (loss * weight).backward()
            totals["loss"] += float(loss.detach()) * weight / A.num_iterations
            share = float(m.sum() / active_tokens) / A.num_iterations
            for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio_mean"):
                totals[key] += float(stats[key]) * share
            totals["entropy"] += float((entropy * m).sum() / active_tokens) / A.num_iterations
        params = [p for p in policy.parameters() if p.requires_grad]
        max_norm = T.max_grad_norm if T.max_grad_norm is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=False)
    return {**totals, "grad_norm": grad_norm, "counts/backward_seqs": len(active) * A.num_iterations,
            "counts/ref_forward_seqs": N if ref_logp is not None else 0}


def accumulation_weight(loss_type: str, rows: int, N: int, tokens: torch.Tensor, total_tokens: torch.Tensor) -> float:
    """Factor for a micro-batch's loss so the summed gradients equal the whole batch's loss gradient.

    grpo and dr_grpo average over sequences (rows/N); bnpo averages over tokens (tokens/total);
    dapo already divides by the whole batch's token count (passed as `normalizer`).
    """
    if loss_type in ("grpo", "dr_grpo"):
        return rows / N
    if loss_type == "bnpo":
        return float(tokens / total_tokens)
    return 1.0


def rollout_metrics(result, rollout: Rollout, G: int) -> dict:
    """Reward and completion statistics, named as TRL names them."""
    rewards = torch.tensor([math.nan if r is None else float(r) for r in result.rewards]).view(-1, G)  # [B, G]
    group_std = torch.stack([row[~row.isnan()].std(unbiased=False) if (~row.isnan()).sum() > 1
                             else torch.tensor(0.0) for row in rewards])
    lengths = rollout.lengths
    out = {"reward": mean(result.rewards), "reward_std": float(group_std.mean()),
           "frac_reward_zero_std": float((group_std < 1e-8).float().mean()),
           "reward_failures": result.failures}
    for name, values in result.per_function.items():
        out[f"rewards/{name}/mean"] = mean(values)
    out.update({"completions/mean_length": sum(lengths) / len(lengths), "completions/max_length": max(lengths),
                "completions/clipped_ratio": sum(rollout.truncated) / len(lengths)})
    return out


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, checkpoint and exit; a second SIGINT aborts."""

    def __init__(self):
        self.requested: str | None = None
        self._old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self._old:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        console.print(f"[yellow]{self.requested}: finishing this step, then writing a checkpoint "
                      f"(Ctrl-C again to abort)")

    def restore(self):
        for s, handler in self._old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
