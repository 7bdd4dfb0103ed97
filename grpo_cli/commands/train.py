"""`grpo train`: the GRPO loop (DeepSeekMath, arXiv 2402.03300, Algorithm 1), top to bottom.

    grpo train                                   # embedded SmolLM2-135M + LoRA, arithmetic, CPU
    grpo train +recipe=gsm8k data.path=train.jsonl trainer.max_steps=100
    grpo train resume=outputs/train/DATE/TIME    # continue a run from its latest checkpoint

Each step: draw prompts -> G completions each (policy with LoRA on) -> rewards -> group-normalized
advantages (outcome or process) -> prepare (reference and old log-probs) -> μ policy updates on the
clipped objective with a k3 KL to the reference policy (the same model with the adapter off) -> log
-> checkpoint. The pieces live below this module: data.PromptStream, rollout/, rewards.score,
update.advantages/prepare/update, objective (the math), checkpoint, metrics. The reward is built here
from `cfg.reward`; iterative RL (`iterative.IterativeRL`) exists only when iterative.iterations > 0.
Sampling draws from the loop's own torch.Generator, seeded per step from (seed, step, rank).

Departures from the paper: the policy trains a LoRA adapter instead of all weights (so the
reference model costs no memory); the reference policy is the initial model for the whole run unless
iterative.iterations > 0 (the paper's iterative RL: grpo_cli/iterative.py retrains the reward model
and resets the reference at each iteration's first step); one "step" is one exploration stage
followed by μ optimizer steps.

Under torchrun (`torchrun --nproc-per-node N $(which grpo) train ...`) each rank runs this loop on its
slice of every step's prompts; grpo_cli.distributed says how the work is split and why, and grpo_cli.fsdp
how `trainer.fsdp=true` shards the frozen base over the ranks.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from transformers import get_scheduler
from transformers.trainer_utils import SchedulerType

from grpo_cli import checkpoint, fsdp
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.checks import Check, Rule, is_int, is_num, raised
from grpo_cli.config import validate
from grpo_cli.data import PromptStream
from grpo_cli.distributed import World, init_world, world_size
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.groups import Draw, GroupFilter
from grpo_cli.instantiate import build
from grpo_cli.iterative import IterativeRL
from grpo_cli.metrics.console import console, progress, quiet
from grpo_cli.metrics.memory import peak_memory_mb, reset_peak_memory, step_memory, synchronize
from grpo_cli.metrics.plots import plot_training
from grpo_cli.metrics.run_files import CompletionsLog, MetricsLog, check_logging
from grpo_cli.metrics.stats import rollout_metrics
from grpo_cli.policy import build_policy
from grpo_cli.rewards import check_columns, function_names, overlong_shaping, score, token_ids
from grpo_cli.rollout import pad_id, render_prompts
from grpo_cli.rollout.engine import AUTO, Choice, choose, run_refusal, say
from grpo_cli.rollout.sizing import Job
from grpo_cli.runs import claim, resume_config
from grpo_cli.update import advantages, prepare, update


@hydra_app("train")
def main(cfg: DictConfig) -> None:
    run(cfg, Path(HydraConfig.get().runtime.output_dir), command_line_overrides())


def run(cfg: DictConfig, run_dir: Path, overrides: list[str] | None = None) -> Path:
    """Train as `cfg` says, writing into `run_dir`; returns the last checkpoint's folder.

    With `resume=`, the run's own saved config is used, changed only by the command line's
    `overrides` that runs.resume_config allows (None: every key of cfg is compared).
    """
    # which engine samples (sampler=auto: vLLM when installed and usable), picked before the checks so they check it
    chosen = choose(cfg.sampler, refused=run_refusal(cfg, world_size()))
    cfg.sampler = chosen.section
    validate(cfg, *CHECKS)
    world = init_world()
    ckpt = None
    if cfg.resume:
        ckpt = checkpoint.resolve(cfg.resume, warn=lambda line: console.print(f"[yellow]{line}"))
        cfg = validate(resume_config(cfg, checkpoint.load_config(ckpt), overrides), *CHECKS)
        chosen = Choice(cfg.sampler, "this run's saved config")  # a resume samples as the run did
        run_dir = ckpt.parent.parent  # the same run goes on in its own folder: one metrics.jsonl, one checkpoints/
    # rank 0 holds the run folder; its verdict (a folder in use, a finished run) stops every rank alike
    lock, refused = None, None
    if world.main:
        try:
            lock = claim(run_dir, resuming=ckpt is not None)
        except ConfigError as err:
            refused = str(err)
    refused = world.broadcast(refused)
    if refused:
        raise ConfigError(refused)
    try:
        return _train(cfg, run_dir, ckpt, world, chosen.why)
    finally:
        if lock is not None:
            lock.release()


def check_world(cfg: DictConfig, size: int) -> list[str]:
    """What `size` ranks (torchrun) need of the config, checked before the model loads."""
    errors = []
    per_step = cfg.trainer.prompts_per_step
    if size > 1 and is_int(per_step) and per_step >= 1 and per_step % size:
        fit = per_step + size - per_step % size
        errors.append(f"trainer.prompts_per_step ({per_step}) must divide by the number of ranks ({size}): each "
                      f"rank takes an equal share of whole groups; set trainer.prompts_per_step={fit}")
    if size > 1 and cfg.trainer.get("fsdp") is True:
        target = str(cfg.sampler.get("_target_", ""))
        # sampler=auto picks HF generate here (engine.run_refusal)
        if not target.startswith("grpo_cli.rollout.hf.") and target != AUTO:
            errors.append(f"trainer.fsdp=true samples with HF generate on the gathered base; sampler {target} pushes "
                          f"whole weights from the policy, which FSDP does not hold: set sampler=default, or "
                          f"trainer.fsdp=false")
        if cfg.model.get("quantization"):  # FSDP2 would shard bitsandbytes' packed 4-bit weights: never tried
            errors.append(f"trainer.fsdp=true with model.quantization={cfg.model.quantization} is not supported: "
                          f"FSDP sharding of a 4-bit base has not been built or tested; set model.quantization=null "
                          f"(the base sharded in full precision) or trainer.fsdp=false (a 4-bit base on every rank)")
    if size > 1 and cfg.iterative.iterations:
        errors.append(f"iterative RL (iterative.iterations={cfg.iterative.iterations}) runs in one process only "
                      f"for now; launch it without torchrun, or set iterative.iterations=0")
    return errors


def _train(cfg: DictConfig, run_dir: Path, ckpt: Path | None, world: World, why: str) -> Path:
    # one rank speaks; the others' numbers reach it through the reductions
    with quiet(not world.main):
        return _loop(cfg, run_dir, ckpt, world, why)


def _loop(cfg: DictConfig, run_dir: Path, ckpt: Path | None, world: World, why: str) -> Path:
    trainer, algo = cfg.trainer, cfg.algo
    report_to = check_logging(trainer)  # a missing tracker package stops here, before the model loads
    # the data and the reward before the model (neither draws from torch's generator), so that a bad path, column
    # or reward function stops the run in seconds; in iterative RL the reward is the reward model retrained at
    # each iteration's first step (which also resets the reference policy to the current one)
    data = build(cfg.data)
    iterative = IterativeRL(cfg, run_dir) if cfg.iterative.iterations else None
    reward_fn = None if iterative else build(cfg.reward)
    # which sampled groups each step trains on: all, or with dynamic sampling those whose filter metric varies
    keep = GroupFilter(algo.dynamic_sampling, algo.filter_metric, algo.max_generation_batches)
    if reward_fn is not None:
        check_columns(reward_fn, data.train[0])
        keep.check_metric(function_names(reward_fn))
    torch.manual_seed(trainer.seed)
    loss = build(algo.loss)
    policy, tokenizer, device = build_policy(cfg.model)
    world.copy_from_main([p for p in policy.parameters() if p.requires_grad])  # one adapter init on every rank
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if trainer.fsdp:  # the frozen base sharded over the ranks; prints how much of it each rank holds
        console.print(fsdp.shard(policy, world))
    # this rank's view of the seeded, resumable stream: every rank advances it alike and keeps its own slice
    prompts = PromptStream(data.train, trainer.seed).shard(world.rank, world.size)
    sampler = build(cfg.sampler)
    sampling = torch.Generator()  # the completions' randomness, reseeded each step: exact resume
    optimizer = build(cfg.optimizer)(params=[p for p in policy.parameters() if p.requires_grad])
    optimizer.zero_grad(set_to_none=False)  # zero (not absent) grads: a step with every row skipped is still a step

    scheduler = get_scheduler(trainer.lr_scheduler, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps * algo.num_iterations)
    state = {"step": 0, "history": []}
    if ckpt is not None:
        checkpoint.load_adapter(policy, ckpt)
        state = checkpoint.load_training_state(ckpt, optimizer, scheduler)
        prompts.load_state_dict(state["data"])
        if iterative:
            iterative.load_state_dict(state, policy, ckpt)
        if "rng" in state:  # dropout's draws (model.lora.dropout > 0) continue where they stopped
            torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
        console.print(f"resumed from {ckpt} at step {state['step']}")
        saved_world = state.get("world_size", 1)
        if saved_world != world.size:
            console.print(f"[yellow]this run was saved by {saved_world} rank(s) and goes on with {world.size}: the "
                          f"prompts and the global batch stay the same, the completions sampled from here on differ "
                          f"from an uninterrupted run's (each rank's sampling seed depends on its rank)")
        aside = checkpoint.set_aside_after(run_dir, state["step"]) if world.main else None
        if aside is not None:
            console.print(f"[yellow]the checkpoints after step {state['step']} (an abandoned branch) moved to {aside}")
    # the engine starts before the first rollout; its saved section says what samples (a fallback), for resume
    # (sized for one step's prompts × group_size on this rank, where the config leaves the engine's sizes null)
    cfg.sampler = sampler.start(policy, cfg.sampler, Job(trainer.prompts_per_step // world.size, algo.group_size))
    say(sampler, why)  # which engine samples and why, in one line
    # the precision the base weights ran in (model.dtype=auto depends on the machine): export.dtype=auto writes it
    state["dtype"] = str(policy.get_input_embeddings().weight.dtype).removeprefix("torch.")
    # rank 0 writes the files; the other ranks' writers do nothing
    log = MetricsLog(run_dir, report_to, trainer.project, OmegaConf.to_container(cfg, resolve=True),
                     writes=world.main)
    samples = CompletionsLog(run_dir, trainer.log_completions_every, trainer.num_completions_to_print,
                             trainer.completions_max_mb)  # every rank gives its completions, rank 0 writes
    if world.main:
        log.truncate(state["step"])
        samples.truncate(state["step"])
    stop = _StopFlag()
    last = None
    tags: dict = {}  # what every step's record carries besides its numbers: the iteration, in iterative RL
    nonfinite_in_a_row = 0
    console.print(f"run dir: {run_dir}")

    # leaving the block (also on an error) closes the trackers' run and puts the signal handlers back
    with progress("train") as bar, log, stop:
        task = bar.add_task("train", total=trainer.max_steps, completed=state["step"], info="")
        for step in range(state["step"] + 1, trainer.max_steps + 1):
            sampling.manual_seed(step_seed(trainer.seed, step, world.rank))  # a function of (seed, step, rank)

            # 0. iterative RL, at an iteration's first step: sample from the policy, label, retrain the reward
            #    model with replay, reference <- policy (DeepSeekMath Algorithm 1)
            if iterative:
                reward_fn = iterative.reward_for(step, policy, tokenizer)
                state.update(iterative.state_dict())
                # at a boundary also the reward models' AUC on fresh samples of the current policy (before/after)
                tags = {"iteration": iterative.iteration(step), **iterative.metrics(step)}
            synchronize(device)  # the timers below count GPU work, not just its queueing
            reset_peak_memory(device)
            t0 = time.perf_counter()

            # 1-3 once, or with dynamic sampling (algo.dynamic_sampling) on fresh prompts until prompts_per_step
            #    groups whose rewards vary are kept (grpo_cli.groups)
            sampler.sync(policy)
            draws, t_rollout = [], 0.0
            while not keep.done(draws, trainer.prompts_per_step, algo.group_size, world):
                # 1. prompts: the next prompts_per_step examples of the seeded, resumable stream (this rank's slice)
                examples = prompts.next(trainer.prompts_per_step)

                # 2. rollout: G completions per prompt with the current policy (LoRA on)
                t = time.perf_counter()
                with fsdp.whole(policy):  # a sharded base gathered while sampling (trainer.fsdp); else nothing
                    rollout = _sample(sampler, policy, tokenizer, examples, algo.group_size, step, sampling)
                synchronize(device)
                t_rollout += time.perf_counter() - t

                # 3. score: one reward per completion, or step rewards (process supervision)
                owners = [i for i in range(len(examples)) for _ in range(algo.group_size)]
                result = score(reward_fn, examples, owners, rollout.texts, rollout.lengths, rollout.truncated,
                               token_ids(rollout))
                # DAPO's soft overlong punishment in the last algo.overlong_buffer tokens (null: none)
                result = overlong_shaping(result, rollout.lengths, cfg.sampler.max_new_tokens, algo.overlong_buffer,
                                          algo.overlong_penalty)
                draws.append(Draw(examples, prompts.positions, rollout, result))
            kept = keep.select(draws, trainer.prompts_per_step, algo.group_size, pad_id(tokenizer), world)
            examples, rollout, result = kept.examples, kept.rollout, kept.result

            # 4. advantages: normalized within each group of G
            adv = advantages(result, rollout, tokenizer, algo.group_size, algo.advantage_scale, algo.advantage_std,
                             world)

            # 5. update: reference and old log-probs first, then μ passes of the clipped objective
            t1 = time.perf_counter()
            batch = prepare(policy, rollout, adv, loss, algo.num_iterations, trainer.micro_batch_size,
                            algo.mask_truncated_completions, world, trainer.bucket_tokens)
            stats = update(policy, optimizer, scheduler, batch, loss, algo.num_iterations, trainer.micro_batch_size,
                           trainer.max_grad_norm)
            synchronize(device)
            now = time.perf_counter()
            t_update, t_step = now - t1, now - t0  # the step: rollout, rewards, advantages and update
            nonfinite_in_a_row = nonfinite_in_a_row + 1 if stats.nonfinite_skipped else 0
            if stats.nonfinite_skipped:
                console.print(f"[yellow]step {step}: non-finite loss or gradient, optimizer step skipped "
                              f"({nonfinite_in_a_row} in a row; the run stops at "
                              f"trainer.max_nonfinite_steps={trainer.max_nonfinite_steps})")

            # 6. log: the metrics; every log_completions_every steps also what the model wrote
            record = {"step": step, **tags,
                      **rollout_metrics(*_everyone(world, result, rollout), algo.group_size), **kept.metrics,
                      **stats.metrics(), "learning_rate": scheduler.get_last_lr()[0], "time/rollout_s": t_rollout,
                      "time/update_s": t_update, "time/step_s": t_step,
                      # every draw's tokens: dynamic sampling samples more than it keeps
                      "tokens_per_s": sum(record_tokens(world, d.rollout) for d in draws) / max(t_rollout, 1e-9),
                      "peak_memory_mb": peak_memory_mb(device), **step_memory(device)}
            if iterative:  # the length-shift alarm: mean length and truncated share against the iteration's start
                record.update(iterative.length_shift(record, state["history"]))
            log.log(record)
            samples.log(step, kept.positions, examples, rollout, result, adv, world)
            state["step"] = step
            state["world_size"] = world.size
            state["data"] = prompts.state_dict()
            state["history"].append({k: v for k, v in record.items() if not k.startswith("time/")})
            bar.update(task, completed=step, info=f"reward {record['reward']:.3f}  kl {record['kl']:.4f}  "
                                                  f"loss {record['loss']:+.4f}  "
                                                  f"len {record['completions/mean_length']:.0f}")

            # 7. checkpoint (rank 0; every rank holds the same weights); a stop asked of any rank stops them all here
            stop.requested = _agreed_stop(world, stop.requested)
            if step % trainer.save_every == 0 or step == trainer.max_steps or stop.requested:
                # dropout's generator (sampling's is reseeded each step from (seed, step, rank))
                state["rng"] = {"torch": torch.get_rng_state().tolist()}
                if world.main:
                    last = checkpoint.save(run_dir, step, policy, optimizer, scheduler, state, cfg, trainer.keep_last)
                last = world.broadcast(last)
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
    console.print(f"checkpoint: {last}\ncurves: {plot_training(run_dir) if world.main else None}")
    return last


def _sample(sampler, policy, tokenizer, examples: list[dict], group_size: int, step: int,
            generator: torch.Generator):
    """G completions per example; a policy whose logits went NaN/inf is a RunError, not a traceback."""
    try:
        return sampler.generate(policy, tokenizer, render_prompts(tokenizer, [e["messages"] for e in examples]),
                                group_size, generator=generator)
    except RuntimeError as err:
        if "inf" in str(err) or "nan" in str(err):  # torch.multinomial on non-finite probabilities
            raise RunError(f"step {step}: sampling failed because the policy's probabilities are not finite "
                           f"({str(err).splitlines()[0]}); an update diverged: lower optimizer.lr and start a new "
                           f"run from an earlier checkpoint's settings") from None
        raise


def _everyone(world: World, result, rollout):
    """(result, rollout)-likes holding every rank's completions, for the step's reward metrics."""
    if world.size == 1:
        return result, rollout

    parts = world.gather((result.rewards, result.per_function, result.failures, rollout.lengths, rollout.truncated))
    per_function = {name: [v for p in parts for v in p[1].get(name, [None] * len(p[0]))] for name in parts[0][1]}
    merged = SimpleNamespace(rewards=[r for p in parts for r in p[0]], per_function=per_function,
                             failures=sum(p[2] for p in parts))
    lengths, truncated = [n for p in parts for n in p[3]], [t for p in parts for t in p[4]]
    return merged, SimpleNamespace(lengths=lengths, truncated=truncated)


def record_tokens(world: World, rollout) -> int:
    """Completion tokens sampled this step, all ranks."""
    return int(world.sum(torch.tensor([sum(rollout.lengths)]))[0])


def _agreed_stop(world: World, requested: str | None) -> str | None:
    """A stop request of any rank, on every rank (so all stop after the same step)."""
    if world.size == 1:
        return requested
    anyone = world.max(torch.tensor([requested is not None], dtype=torch.int64))
    return requested or ("a stop request on another rank" if int(anyone[0]) else None)


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of one step on one rank; rank 0 keeps the 1-process seeds, so a 1-rank run is unchanged."""
    return (seed * 1_000_003 + step + rank * 7_919_000_003) % 2**63


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

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _schedulers() -> list[str]:
    return [s.value for s in SchedulerType]


# the trainer section's checks, which `run` hands to config.validate beside every library module's
CHECKS: list[Check] = [
    Rule("trainer.seed", lambda v: is_int(v) and v >= 0, "must be an integer >= 0; set trainer.seed=0"),
    Rule("trainer.lr_scheduler", lambda v: v in _schedulers(),
         "must be a transformers scheduler name (constant, constant_with_warmup, linear, cosine, ...); "
         "set trainer.lr_scheduler=constant_with_warmup"),
    Rule("trainer.warmup_steps", lambda v: is_int(v) and v >= 0,
         "must be an integer >= 0; set trainer.warmup_steps=0"),
    Rule("trainer.gradient_checkpointing", lambda v: isinstance(v, bool),
         "must be true or false; set trainer.gradient_checkpointing=false"),
    Rule("trainer.fsdp", lambda v: isinstance(v, bool), "must be true or false; set trainer.fsdp=false"),
    Rule("trainer.max_nonfinite_steps", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set trainer.max_nonfinite_steps=3"),
    Rule("trainer.max_steps", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set trainer.max_steps=10"),
    Rule("trainer.prompts_per_step", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set trainer.prompts_per_step=4"),
    Rule("trainer.micro_batch_size", lambda v: is_int(v) and v >= 1,
         "must be an integer >= 1; set trainer.micro_batch_size=8"),
    Rule("trainer.bucket_tokens", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (8 rows a bucket); set trainer.bucket_tokens=1024"),
    Rule("trainer.save_every", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set trainer.save_every=20"),
    Rule("trainer.keep_last", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (keep all); set trainer.keep_last=3"),
    Rule("trainer.max_grad_norm", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 or null (no clipping); set trainer.max_grad_norm=1.0"),
    lambda cfg: raised(check_logging)(cfg.trainer),
    lambda cfg: check_world(cfg, world_size()),
]


if __name__ == "__main__":
    sys.exit(main())
