"""The GRPO training recipe: `setup(cfg) -> Run`, `resume(run, checkpoint)`, `step(run, n) -> StepRecord`.

    run = setup(cfg, run_dir, world, why)      # build every component once, in an order that makes runs exact
    resume(run, checkpoint)                    # optional: weights, optimizer, prompt stream, reward schedule
    record = step(run, 1)                      # one GRPO step; grpo_cli.commands.train loops, logs and saves

`step` is the inner loop of DeepSeekMath's Algorithm 1 (arXiv 2402.03300): draw prompts -> G completions
each from the policy (adapter on) -> rewards -> group-normalized advantages (outcome or process) -> the
reference and old log-probs -> μ updates of the clipped objective with a k3 KL to the reference policy (the
same model with the adapter off). Which reward scores a step is the run's reward schedule's business
(`grpo_cli.reward_schedule`: a fixed reward, or iterative RL); which engine samples is the sampler's.

`Run` is built once and read by every step; the composed config is never written to: the config the run saves
(`Run.cfg`) is the composed one with the sampler section that actually samples (sampler=auto resolved, or an
engine's fallback), so a resume samples as the run did.

Departures from the paper: the policy trains a LoRA adapter instead of all weights (so the reference costs no
memory; model.finetune=full trains them all, the reference a frozen copy of the initial weights); one step is
one exploration stage followed by μ optimizer steps; sampling draws from the run's own torch.Generator, reseeded
each step from (seed, step, rank), so a resumed run samples what the uninterrupted one did. Under torchrun each
rank runs the step on its slice of the step's prompts (grpo_cli.distributed).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from transformers import get_scheduler

from grpo_cli import checkpoint, compiled, files, fsdp
from grpo_cli.algo import build_loss
from grpo_cli.components import assemble
from grpo_cli.credit import advantages, token_rewards
from grpo_cli.data import PromptStream
from grpo_cli.distributed import World
from grpo_cli.errors import RunError
from grpo_cli.evaluation import eval_line, eval_metrics, eval_problems, greedy_rows
from grpo_cli.groups import GroupFilter, Groups
from grpo_cli.instantiate import build
from grpo_cli.lengths import check_prompt_lengths
from grpo_cli.metrics.console import console
from grpo_cli.metrics.memory import peak_memory_mb, reset_peak_memory, step_memory, synchronize
from grpo_cli.metrics.run_files import CompletionsLog, MetricsLog, check_logging
from grpo_cli.metrics.stats import rollout_metrics
from grpo_cli.objective import Loss
from grpo_cli.policy import build_policy, context_length, keep_reference, load_tokenizer, pad_id
from grpo_cli.reward_schedule import RewardSchedule
from grpo_cli.rewards import RewardResult
from grpo_cli.rewards.call import score
from grpo_cli.rewards.shaping import overlong_lengths, shape
from grpo_cli.rollout import Tally, render_prompts
from grpo_cli.rollout.ahead import Ahead, shared_cores
from grpo_cli.rollout.sizing import Job
from grpo_cli.runs import keep_chat_template
from grpo_cli.trainer_state import TrainerState
from grpo_cli.update import prepare, update


@dataclass(frozen=True)
class Run:
    """A training run's components, built once by `setup`; `state` is the one part a step advances."""

    cfg: DictConfig             # the run's config as saved: the composed one, with the sampler section that samples
    run_dir: Path
    world: World
    policy: Any                 # the peft model: base + LoRA (the reference: adapter off); full: the causal LM
    tokenizer: Any
    device: torch.device
    sampler: Any                # a started rollout engine (grpo_cli.rollout's Sampler contract)
    rewards: RewardSchedule
    prompts: PromptStream       # this rank's slice of the seeded, resumable prompt stream
    keep: GroupFilter           # which sampled groups a step trains on (dynamic sampling)
    loss: Loss                  # objective.GRPOLoss, built from the algo section (algo.build_loss)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    generator: torch.Generator  # the completions' randomness, reseeded each step
    log: MetricsLog             # RUN/metrics.jsonl and the trackers (rank 0 writes)
    samples: CompletionsLog     # RUN/completions.jsonl and the console's tables
    state: TrainerState         # trainer_state.json: step, history, prompt-stream position, rng, ...
    decoder: Any = None         # the update's compiled decoder (trainer.compile, grpo_cli.compiled); None: eager
    heldout: list = field(default_factory=list)  # the problems each in-run eval scores (trainer.eval_size); []: off
    # rollouts in flight for the next steps (algo.max_staleness = K); K = 0: none, the synchronous loop
    ahead: Ahead = field(default_factory=lambda: Ahead(0))
    # model.finetune=full with β > 0: the frozen copy of the initial weights the KL term reads (policy.keep_reference);
    # None: the reference is the LoRA adapter switched off (or the iteration's `reference` adapter)
    reference: Any = None


@dataclass(frozen=True)
class StepRecord:
    """One step: its metrics.jsonl record, the groups it trained on and their advantages, and the reward that scored
    them (an in-run eval scores with it too)."""

    step: int
    metrics: dict[str, Any]
    kept: Groups                # this rank's share of the groups the step trained on
    advantages: torch.Tensor    # [N] outcome or [N, T] process, this rank's rows
    nonfinite_skipped: bool     # a non-finite loss or gradient: no optimizer step was taken
    reward: Any = None


def with_section(cfg: DictConfig, key: str, section: DictConfig) -> DictConfig:
    """A copy of `cfg` whose section `key` is `section` (the composed config itself is left as it is)."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        out[key] = section
    return out


def templated_rows(data, tokenizer) -> list[tuple[str, str]]:
    """(where, prompt) of every row of the data, chat-templated as the sampler templates it; none for a generated
    task, whose settings bound its prompts."""
    rows = data.prompt_rows()  # [(where, messages)]
    texts = render_prompts(tokenizer, [messages for _, messages in rows]) if rows else []
    return [(where, str(text)) for (where, _), text in zip(rows, texts)]


def check_lengths(cfg: DictConfig, data, tokenizer) -> None:
    """Every prompt of a user's data within sampler.max_prompt_tokens, or one DataError naming a row."""
    check_prompt_lengths(templated_rows(data, tokenizer), tokenizer, cfg.sampler.max_prompt_tokens,
                         context=context_length(cfg.model), max_new_tokens=cfg.sampler.max_new_tokens)


def setup(cfg: DictConfig, run_dir: Path, world: World, why: str) -> Run:
    """Build the run's components from a validated config and start the rollout engine (`why`: the engine line).

    The data and the reward come before the model (neither draws from torch's generator), so a bad path, column or
    reward function stops the run in seconds; then the seed, and the policy, whose LoRA init draws from it.
    """
    trainer, algo = cfg.trainer, cfg.algo
    report_to = check_logging(trainer)  # a missing tracker package stops here, before the model loads
    # the data, the environment, the reward schedule and the dynamic-sampling filter, their columns checked
    parts = assemble(cfg, "train", run_dir=run_dir, why=why)
    data = parts.data
    heldout = eval_problems(data, trainer.eval_every, trainer.eval_size)  # a split too small for eval_size stops here
    # a user's data: every prompt measured before the model loads, where its tokenizer loads without it
    early = load_tokenizer(cfg.model) if data.prompt_rows() else None
    if early is not None:
        parts.template(early)
        check_lengths(cfg, data, early)
    cfg = keep_chat_template(cfg, run_dir, data.chat_template, world.main)
    torch.manual_seed(trainer.seed)
    loss = build_loss(algo)
    policy, tokenizer, device = build_policy(cfg.model)
    parts.template(tokenizer)
    if cfg.model.init_adapter:  # before a resume, which loads the run's own adapter over it
        console.print(checkpoint.start_from(policy, cfg.model.init_adapter, loss.needs_reference))
    frozen, line = keep_reference(policy, loss.needs_reference)  # model.finetune=full: the initial weights, if β > 0
    if line:
        console.print(line)
    if early is None:
        check_lengths(cfg, data, tokenizer)
    world.copy_from_main([p for p in policy.parameters() if p.requires_grad])  # one adapter init on every rank
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the frozen base sharded over the ranks (model.finetune=full: every weight and the frozen reference); prints how
    # much each rank holds
    if trainer.fsdp:
        console.print(fsdp.shard(policy, world, frozen))
    decoder = compiled.for_update(policy, cfg, say=console.print)  # compiled at the first update
    # every rank advances the stream alike and keeps its own slice
    prompts = PromptStream(data.train, trainer.seed).shard(world.rank, world.size)
    optimizer = build(cfg.optimizer)(params=[p for p in policy.parameters() if p.requires_grad])
    optimizer.zero_grad(set_to_none=False)  # zero (not absent) grads: a step with every row skipped is still a step
    scheduler = get_scheduler(trainer.lr_scheduler, optimizer, num_warmup_steps=trainer.warmup_steps,
                              num_training_steps=trainer.max_steps * algo.num_iterations)
    # the engine starts before the first rollout, sized for one step's prompts x group_size on this rank where the
    # config leaves its sizes null; the section it returns (a fallback's) is what the run saves
    sampler, section = parts.start(policy, Job(trainer.prompts_per_step // world.size, algo.group_size))
    cfg = with_section(cfg, "sampler", section)
    # rollouts ahead from a server on this machine, which the trainer's CPU work would share: one line on pinning them
    if world.main and (line := shared_cores(algo.max_staleness, cfg.sampler.get("url"), device.type)):
        console.print(line)
    # the precision the base weights ran in (model.dtype=auto depends on the machine): export.dtype=auto writes it
    dtype = str(policy.get_input_embeddings().weight.dtype).removeprefix("torch.")
    log = MetricsLog(run_dir, report_to, trainer.project, OmegaConf.to_container(cfg, resolve=True),
                     writes=world.main)  # rank 0 writes the files; the other ranks' writers do nothing
    samples = CompletionsLog(run_dir, trainer.log_completions_every, trainer.num_completions_to_print,
                             trainer.completions_max_mb)  # every rank gives its completions, rank 0 writes
    return Run(cfg, Path(run_dir), world, policy, tokenizer, device, sampler, parts.reward, prompts, parts.keep, loss,
               optimizer, scheduler, torch.Generator(), log, samples, TrainerState(step=0, history=[], dtype=dtype),
               decoder, heldout, Ahead(algo.max_staleness), frozen)


def resume(run: Run, ckpt: Path) -> None:
    """Continue `run` from checkpoint folder `ckpt`: adapter, optimizer and scheduler, prompt stream, reward
    schedule, dropout's RNG; later checkpoints (an abandoned branch) are set aside."""
    checkpoint.load_weights(run.policy, ckpt)
    state = checkpoint.load_training_state(ckpt, run.optimizer, run.scheduler)
    run.prompts.load_state_dict(state["data"])
    run.rewards.load_state_dict(state, run.policy, ckpt)
    if "rng" in state:  # dropout's draws (model.lora.dropout > 0) continue where they stopped
        torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
    run.state.load(state)
    run.ahead.load_state_dict(state.get("ahead"), run.sampler, run.tokenizer, run.device)  # those in flight
    console.print(f"resumed from {ckpt} at step {state['step']}")
    saved_world = state.get("world_size", 1)
    if saved_world != run.world.size:
        console.print(f"[yellow]this run was saved by {saved_world} rank(s) and goes on with {run.world.size}: the "
                      f"prompts and the global batch stay the same, the completions sampled from here on differ "
                      f"from an uninterrupted run's (each rank's sampling seed depends on its rank)")
    aside = checkpoint.set_aside_after(run.run_dir, state["step"]) if run.world.main else None
    if aside is not None:
        console.print(f"[yellow]the checkpoints after step {state['step']} (an abandoned branch) moved to {aside}")


def step(run: Run, n: int) -> StepRecord:
    """Step `n` of the run: sample, score, advantages, update; returns its record and advances `run.state`."""
    trainer, algo, world = run.cfg.trainer, run.cfg.algo, run.world
    run.generator.manual_seed(step_seed(trainer.seed, n, world.rank))  # a function of (seed, step, rank)
    # 0. the step's reward (iterative RL, at an iteration's first step: retrain the reward model, reference <- policy)
    reward, tags = run.rewards.begin(n, run.policy, run.tokenizer)
    run.state.iterative = run.rewards.state_dict().get("iterative")
    synchronize(run.device)  # the timers below count GPU work, not just its queueing
    reset_peak_memory(run.device)
    t0 = time.perf_counter()

    # 1-3. prompts -> G completions each -> rewards (with dynamic sampling, until enough groups carry signal)
    kept, filtered, draws, t_rollout = _explore(run, n, reward)

    # 4. advantages: the rewards on the tokens they pay (outcome, steps, turns), then normalized within each group of G
    on_tokens = token_rewards(kept.result, kept.rollout, run.tokenizer)
    adv = advantages(on_tokens, kept.size, algo.advantage_scale, algo.advantage_std, world, estimator=algo.advantage)

    # 5. update: reference and old log-probs first, then μ passes of the clipped objective
    t1 = time.perf_counter()
    batch = prepare(run.policy, kept.rollout, adv, run.loss, algo.num_iterations, trainer.micro_batch_size,
                    algo.mask_truncated_completions, world, trainer.bucket_tokens, run.reference)
    stats = update(run.policy, run.optimizer, run.scheduler, batch, max_grad_norm=trainer.max_grad_norm,
                   decoder=run.decoder)
    synchronize(run.device)
    now = time.perf_counter()
    if run.decoder is not None and (line := run.decoder.report()):  # the compile's seconds, on their own line
        console.print(line)

    # 6. the step's record: rewards, lengths, the update's numbers, time and memory
    metrics = {"step": n, **tags, **rollout_metrics(*_everyone(world, kept), kept.size), **filtered,
               **stats.metrics(), "learning_rate": run.scheduler.get_last_lr()[0],
               "time/rollout_s": t_rollout, "time/update_s": now - t1, "time/step_s": now - t0,
               # updates between the policy that sampled the step's rollouts and the one it updates
               **run.ahead.metrics(),
               # every draw's tokens: dynamic sampling samples more than it keeps
               "tokens_per_s": sum(record_tokens(world, d.rollout) for d in draws) / max(t_rollout, 1e-9),
               "peak_memory_mb": peak_memory_mb(run.device), **step_memory(run.device)}
    metrics.update(run.rewards.after(metrics, run.state.history))
    run.state.step, run.state.world_size, run.state.data = n, world.size, run.prompts.state_dict()
    run.state.history.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    return StepRecord(n, metrics, kept, adv, bool(stats.nonfinite_skipped), reward)


def held_out(run: Run, record: StepRecord) -> dict:
    """The in-run eval after step `record.step`'s update (trainer.eval_every): greedy completions of `run.heldout`
    from the run's own engine, the update's weights pushed first, scored by the step's reward as `grpo eval` scores
    them; returns its numbers (eval/*, time/eval_s), added to the step's record, and prints one line.

    Every rank takes every N-th problem, in batches of one step's rollout (what the engine was sized for), and the
    rows are gathered. Neither the run's generator nor torch's global one moves, nor the prompt stream, so the run
    trains on as it would have without the eval (dropout off while it decodes, as in `grpo eval`)."""
    t, policy, world = time.perf_counter(), run.policy, run.world
    batch = max(1, run.cfg.trainer.prompts_per_step // world.size) * run.cfg.algo.group_size
    was_training = policy.training
    cuda = [run.device.index or 0] if run.device.type == "cuda" else []
    run.sampler.sync(policy)
    with torch.random.fork_rng(devices=cuda), run.sampler.gathered(policy):
        policy.eval()
        try:
            rows = greedy_rows(policy, run.tokenizer, run.sampler, record.reward, run.heldout, world, batch)
        finally:
            policy.train(was_training)
    scores = eval_metrics(rows)
    if world.main:  # every problem's row (grpo eval's), in the split's order: two runs compare problem by problem
        rows = sorted(rows, key=lambda row: row["index"])
        files.write_text(run.run_dir / "evals" / f"step_{record.step:06d}.jsonl",
                         "".join(json.dumps(row) + "\n" for row in rows))
    console.print(eval_line(record.step, scores, len(rows)), highlight=False)
    run.state.history[-1].update(scores)  # the guard's held-out tripwire reads the evals there (grpo_cli.guard)
    scores["time/eval_s"] = time.perf_counter() - t
    record.metrics.update(scores)
    return scores


def _explore(run: Run, n: int, reward) -> tuple[Groups, dict, list[Groups], float]:
    """Steps 1-3 once, or with dynamic sampling (algo.dynamic_sampling) on fresh prompts until prompts_per_step
    groups whose rewards vary are kept (grpo_cli.groups): (what the step trains on, the filter's dynamic/...
    metrics, every draw, rollout seconds)."""
    trainer, algo, world = run.cfg.trainer, run.cfg.algo, run.world
    run.sampler.sync(run.policy)
    draws, t_rollout = [], 0.0
    while not run.keep.done(draws, trainer.prompts_per_step, world):
        # 1. prompts: the next prompts_per_step examples of the seeded, resumable stream (this rank's slice)
        examples = run.prompts.next(trainer.prompts_per_step)

        # 2. rollout: G completions per prompt with the current policy (LoRA on); with algo.max_staleness = K, taken
        #    from those sampled ahead while earlier updates ran, and steps n+1 ... n+K's sent to the server now
        t = time.perf_counter()
        rollout = run.ahead.take(n)
        if rollout is None:
            with run.sampler.gathered(run.policy):  # a base sharded by trainer.fsdp gathered, unless a server samples
                rollout = _sample(run, examples, n)
        run.ahead.launch(n, trainer.max_steps, run.sampler, run.policy, run.tokenizer,
                         lambda skip: run.prompts.peek(trainer.prompts_per_step, skip), algo.group_size,
                         lambda s: step_seed(trainer.seed, s, world.rank))
        synchronize(run.device)
        t_rollout += time.perf_counter() - t

        # 3. score: one reward per completion, or step rewards (process supervision); then shaped: the reward
        #    schedule's floor for truncated completions, DAPO's soft overlong punishment (algo.overlong_buffer)
        result = score(reward, examples, rollout)
        lengths, cap = overlong_lengths(rollout, run.cfg.sampler.max_new_tokens,
                                        OmegaConf.select(run.cfg, "env.max_episode_tokens"))  # an episode's budget
        result = shape(result, lengths=lengths, truncated=rollout.truncated, completions=rollout.texts,
                       max_length=cap, overlong_buffer=algo.overlong_buffer,
                       overlong_penalty=algo.overlong_penalty, truncated_reward=run.rewards.truncated_reward)
        draws.append(Groups(examples, run.prompts.positions, rollout, result, algo.group_size))
    kept, filtered = run.keep.select(draws, trainer.prompts_per_step, pad_id(run.tokenizer), world)
    return kept, filtered, draws, t_rollout


def _sample(run: Run, examples: list[dict], n: int):
    """G completions per example; a policy whose logits went NaN/inf is a RunError, not a traceback."""
    try:
        return run.sampler.sample(run.policy, run.tokenizer, examples, run.cfg.algo.group_size,
                                  generator=run.generator)
    except RuntimeError as err:
        if "inf" in str(err) or "nan" in str(err):  # torch.multinomial on non-finite probabilities
            raise RunError(f"step {n}: sampling failed because the policy's probabilities are not finite "
                           f"({str(err).splitlines()[0]}); an update diverged: lower optimizer.lr and start a new "
                           f"run from an earlier checkpoint's settings") from None
        raise


def _everyone(world: World, kept: Groups) -> tuple[RewardResult, Tally]:
    """The rewards and the rollout's tally (lengths, truncation, episodes' counts: what pickles) of every rank's
    completions, joined in rank order, for the step's reward and episode metrics."""
    if world.size == 1:
        return kept.result, kept.rollout.tally()
    parts = world.gather((kept.result, kept.rollout.tally()))
    return RewardResult.cat([p[0] for p in parts]), Tally.cat([p[1] for p in parts])


def record_tokens(world: World, rollout) -> int:
    """Completion tokens sampled this step, all ranks."""
    return int(world.sum(torch.tensor([sum(rollout.lengths)]))[0])


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of one step on one rank; rank 0 keeps the 1-process seeds, so a 1-rank run is unchanged."""
    return (seed * 1_000_003 + step + rank * 7_919_000_003) % 2**63


def save(run: Run, n: int) -> Path:
    """Checkpoint step `n` (rank 0 writes; every rank holds the same weights, or with a sharded full-parameter
    policy every rank gives its shards and rank 0 writes them whole, as one process would); its folder, on every
    rank."""
    run.state.rng = {"torch": torch.get_rng_state().tolist()}  # dropout's (sampling's is reseeded per step)
    run.state.ahead = run.ahead.saved().get("ahead")  # the rollouts in flight, waited for: a resume trains on them
    gathered = None
    if fsdp.sharded_weights(run.policy.parameters()):  # a collective: every rank, before rank 0 writes
        gathered = fsdp.gather_state(run.policy, run.optimizer, run.world.main)
    last = None
    if run.world.main:
        last = checkpoint.save(run.run_dir, n, run.policy, run.optimizer, run.scheduler, run.state.to_json(), run.cfg,
                               run.cfg.trainer.keep_last, gathered=gathered)
    return run.world.broadcast(last)
