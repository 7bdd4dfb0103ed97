"""`grpo train`: the GRPO loop (DeepSeekMath, arXiv 2402.03300, Algorithm 1), top to bottom.

    grpo train                                   # embedded SmolLM2-135M + LoRA, arithmetic, CPU
    grpo train +recipe=gsm8k data.path=train.jsonl trainer.max_steps=100
    grpo train resume=outputs/train/DATE/TIME    # continue a run from its latest checkpoint

Each step: draw prompts -> G completions each (policy with LoRA on) -> rewards -> group-normalized
advantages (outcome or process) -> prepare (reference and old log-probs) -> μ policy updates on the
clipped objective with a k3 KL to the reference policy (the same model with the adapter off) -> log
-> checkpoint. The pieces live below this module: data.PromptStream, rollout/, rewards.score,
update.advantages/prepare/update, objective (the math), checkpoint, metrics.

Departures from the paper: the policy trains a LoRA adapter instead of all weights (so the
reference model costs no memory); the reference policy is the initial model for the whole run unless
iterative.iterations > 0 (the paper's iterative RL: grpo_cli/iterative.py retrains the reward model
and resets the reference at each iteration's first step); one "step" is one exploration stage
followed by μ optimizer steps.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from grpo_cli import checkpoint
from grpo_cli.config import build, command_line_overrides, hydra_app, validate
from grpo_cli.data import PromptStream
from grpo_cli.errors import RunError
from grpo_cli.iterative import Iterations
from grpo_cli.iterative import check_settings as check_iterative
from grpo_cli.metrics import (
    CompletionsLog,
    MetricsLog,
    check_logging,
    console,
    limit_heap_growth,
    peak_memory_mb,
    plot_training,
    progress,
    rollout_metrics,
)
from grpo_cli.policy import build_policy
from grpo_cli.rewards import score
from grpo_cli.rollout import render_prompts
from grpo_cli.runs import claim, resume_config
from grpo_cli.update import advantages, prepare, update


@hydra_app("train")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    run(cfg, Path(HydraConfig.get().runtime.output_dir), command_line_overrides())


def run(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> Path:
    """Train as `cfg` says, writing into `run_dir`; returns the last checkpoint's folder.

    With `resume=`, the run's own saved config is used, changed only by the command line's
    `overrides` that runs.resume_config allows (None: every key of cfg is compared).
    """
    check_iterative(validate(cfg))
    ckpt = None
    if cfg.resume:
        ckpt = checkpoint.resolve(cfg.resume, warn=lambda line: console.print(f"[yellow]{line}"))
        cfg = validate(resume_config(cfg, checkpoint.load_config(ckpt), overrides))
        check_iterative(cfg)
        run_dir = ckpt.parent.parent  # the same run goes on in its own folder: one metrics.jsonl, one checkpoints/
    lock = claim(run_dir, resuming=ckpt is not None)
    try:
        return _train(cfg, run_dir, ckpt)
    finally:
        lock.release()


def _train(cfg: DictConfig, run_dir: Path, ckpt: Path | None) -> Path:
    limit_heap_growth()
    trainer, algo = cfg.trainer, cfg.algo
    report_to = check_logging(trainer)  # a missing tracker package stops here, before the model loads
    torch.manual_seed(trainer.seed)
    loss = build(algo.loss)
    policy, tokenizer, device = build_policy(cfg.model)
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts = PromptStream(build(cfg.data).train, trainer.seed)
    # the reward function of each step: build(cfg.reward), or in iterative RL the reward model retrained at each
    # iteration's first step (which also resets the reference policy to the current one)
    iterations = Iterations(cfg, run_dir)
    sampler = build(cfg.sampler)
    optimizer = build(cfg.optimizer)(params=[p for p in policy.parameters() if p.requires_grad])
    optimizer.zero_grad(set_to_none=False)  # zero (not absent) grads: a step with every row skipped is still a step
    from transformers import get_scheduler

    scheduler = get_scheduler(trainer.lr_scheduler, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps * algo.num_iterations)
    state = {"step": 0, "history": []}
    if ckpt is not None:
        checkpoint.load_adapter(policy, ckpt)
        state = checkpoint.load_training_state(ckpt, optimizer, scheduler)
        prompts.load_state_dict(state["data"])
        iterations.load_state_dict(state, policy, ckpt)
        console.print(f"resumed from {ckpt} at step {state['step']}")
        aside = checkpoint.set_aside_after(run_dir, state["step"])
        if aside is not None:
            console.print(f"[yellow]the checkpoints after step {state['step']} (an abandoned branch) moved to {aside}")
    log = MetricsLog(run_dir, report_to, trainer.project, OmegaConf.to_container(cfg, resolve=True))
    samples = CompletionsLog(run_dir, trainer.log_completions_every, trainer.num_completions_to_print,
                             trainer.completions_max_mb)
    log.truncate(state["step"])
    samples.truncate(state["step"])
    stop = _StopFlag()
    last = None
    nonfinite_in_a_row = 0
    console.print(f"run dir: {run_dir}")

    # leaving the block (also on an error) closes the trackers' run and puts the signal handlers back
    with progress("train") as bar, log, stop:
        task = bar.add_task("train", total=trainer.max_steps, completed=state["step"], info="")
        for step in range(state["step"] + 1, trainer.max_steps + 1):
            _seed_step(trainer.seed, step)  # sampling randomness is a function of (seed, step): exact resume

            # 0. iterative RL, at an iteration's first step: sample from the policy, label, retrain the reward
            #    model with replay, reference <- policy (DeepSeekMath Algorithm 1); otherwise the run's reward
            reward_fn = iterations.reward_for(step, policy, tokenizer)
            t0 = time.perf_counter()

            # 1. prompts: the next prompts_per_step examples of the seeded, resumable stream
            examples = prompts.next(trainer.prompts_per_step)

            # 2. rollout: G completions per prompt with the current policy (LoRA on)
            sampler.sync(policy)
            rollout = _sample(sampler, policy, tokenizer, examples, algo.group_size, step)
            t_rollout = time.perf_counter() - t0

            # 3. score: one reward per completion, or step rewards (process supervision)
            owners = [i for i in range(len(examples)) for _ in range(algo.group_size)]
            result = score(reward_fn, examples, owners, rollout.texts, rollout.lengths, rollout.truncated)

            # 4. advantages: normalized within each group of G
            adv = advantages(result, rollout, tokenizer, algo.group_size, algo.advantage_scale, algo.advantage_std)

            # 5. update: reference and old log-probs first, then μ passes of the clipped objective
            t1 = time.perf_counter()
            batch = prepare(policy, rollout, adv, loss, algo.num_iterations, trainer.micro_batch_size,
                            algo.mask_truncated_completions)
            stats = update(policy, optimizer, scheduler, batch, loss, algo.num_iterations, trainer.micro_batch_size,
                           trainer.max_grad_norm)
            t_update = time.perf_counter() - t1
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if stats["nonfinite_skipped"] else 0
            if stats["nonfinite_skipped"]:
                console.print(f"[yellow]step {step}: non-finite loss or gradient, optimizer step skipped "
                              f"({nonfinite_in_a_row} in a row; the run stops at "
                              f"trainer.max_nonfinite_steps={trainer.max_nonfinite_steps})")

            # 6. log: the metrics; every log_completions_every steps also what the model wrote
            record = {"step": step, **iterations.metrics(step), **rollout_metrics(result, rollout, algo.group_size),
                      **stats, "learning_rate": scheduler.get_last_lr()[0], "time/rollout_s": t_rollout,
                      "time/update_s": t_update, "tokens_per_s": sum(rollout.lengths) / max(t_rollout, 1e-9),
                      "peak_memory_mb": peak_memory_mb(device)}
            log.log(record)
            samples.log(step, prompts.position - len(examples), examples, rollout, result, adv)
            state["step"] = step
            state["data"] = prompts.state_dict()
            state.update(iterations.state_dict())
            state["history"].append({k: v for k, v in record.items() if not k.startswith("time/")})
            bar.update(task, completed=step, info=f"reward {record['reward']:.3f}  kl {record['kl']:.4f}  "
                                                  f"loss {record['loss']:+.4f}  "
                                                  f"len {record['completions/mean_length']:.0f}")

            # 7. checkpoint
            if step % trainer.save_every == 0 or step == trainer.max_steps or stop.requested:
                # a record for inspection: resume does not need it, each step reseeds from (seed, step)
                state["rng"] = {"torch": torch.get_rng_state().tolist(), "python": list(random.getstate()[1])}
                last = checkpoint.save(run_dir, step, policy, optimizer, scheduler, state, cfg, trainer.keep_last)
            if stop.requested:
                console.print(f"stopped by {stop.requested} after step {step}; checkpoint: {last}\n"
                              f"resume with: grpo train resume={run_dir}")
                break
            if nonfinite_in_a_row >= trainer.max_nonfinite_steps:
                raise RunError(f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                               f"{step}); the last good checkpoint is {last or 'none'}: lower optimizer.lr or "
                               f"check the rewards, and start a new run")
    if last is None:  # resumed at or past max_steps: nothing to do
        last = checkpoint.resolve(run_dir)
    console.print(f"checkpoint: {last}\ncurves: {plot_training(run_dir)}")
    return last


def _sample(sampler, policy, tokenizer, examples: list[dict], group_size: int, step: int):
    """G completions per example; a policy whose logits went NaN/inf is a RunError, not a traceback."""
    try:
        return sampler.generate(policy, tokenizer, render_prompts(tokenizer, [e["messages"] for e in examples]),
                                group_size)
    except RuntimeError as err:
        if "inf" in str(err) or "nan" in str(err):  # torch.multinomial on non-finite probabilities
            raise RunError(f"step {step}: sampling failed because the policy's probabilities are not finite "
                           f"({str(err).splitlines()[0]}); an update diverged: lower optimizer.lr and start a new "
                           f"run from an earlier checkpoint's settings") from None
        raise


def _seed_step(seed: int, step: int) -> None:
    s = (seed * 1_000_003 + step) % 2**63
    random.seed(s)
    torch.manual_seed(s)


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, checkpoint and exit; a second one aborts
    (KeyboardInterrupt), which also frees a step stuck in a reward that has no timeout."""

    def __init__(self):
        self.requested: str | None = None
        self._old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self._old:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        console.print(f"[yellow]{self.requested}: finishing this step, then writing a checkpoint "
                      f"(send it again to abort)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)
        return False


if __name__ == "__main__":
    sys.exit(main())
