"""`grpo train`: the GRPO loop (DeepSeekMath, arXiv 2402.03300, Algorithm 1), top to bottom.

    grpo train                                   # embedded SmolLM2-135M + LoRA, arithmetic, CPU
    grpo train +recipe=gsm8k data.path=train.jsonl trainer.max_steps=100
    grpo train resume=outputs/train/DATE/TIME    # continue a run from its latest checkpoint

This module owns the run folder (one process trains in it; a resume goes on in its own) and the loop: step,
log, checkpoint, until trainer.max_steps or a stop request. What one step does, and how the run's components
are built and resumed, is grpo_cli.recipe (`setup`, `resume`, `step`).

Under torchrun (`torchrun --nproc-per-node N $(which grpo) train ...`) each rank runs this loop on its slice of
every step's prompts; grpo_cli.distributed says how the work is split and why, and grpo_cli.fsdp how
`trainer.fsdp=true` shards the frozen base over the ranks (model.finetune=full: every weight, gradient and optimizer
state).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from transformers.trainer_utils import SchedulerType

from grpo_cli import checkpoint, compiled, guard
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.checks import Check, Rule, is_int, is_num, raised
from grpo_cli.config import validate
from grpo_cli.distributed import World, init_world, world_size
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.metrics.console import console, progress, quiet
from grpo_cli.metrics.plots import plot_training
from grpo_cli.metrics.run_files import check_logging
from grpo_cli.policy import trainable_dtype
from grpo_cli.recipe import Run, held_out, save, setup, step, with_section
from grpo_cli.rollout.engine import AUTO, SERVER, Choice, choose, run_refusal
from grpo_cli.rollout.episodes import env_closed
from grpo_cli.runs import anchored, claim, read_saved, resume_config


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
    cfg = validate(with_section(cfg, "sampler", chosen.section), *CHECKS)
    # relative paths made absolute here, as the run saves them: it resumes and evaluates from any folder
    cfg = anchored(cfg, Path.cwd())
    world = init_world()
    ckpt = None
    if cfg.resume:
        ckpt = checkpoint.resolve(cfg.resume, warn=lambda line: console.print(f"[yellow]{line}"))
        # data, not code: only grpo_cli's own components unless trust_run_config=true (runs.check_saved)
        saved = read_saved(ckpt, None, overrides, cfg.trust_run_config, upgraded=False)  # resume_config upgrades it
        cfg = validate(resume_config(cfg, saved, overrides), *CHECKS)
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
        # one rank speaks (the others' numbers reach it through the reductions); a rank that dies is named in one
        # line, also when FSDP's own gathers inside a forward or backward are the collectives that break
        with quiet(not world.main), world.lost_rank(collective=False):
            training = setup(cfg, run_dir, world, chosen.why)
            training.state.started_in = str(Path.cwd())  # a resume keeps the run's own (recipe.resume)
            if ckpt is not None:
                training = guard.resume(training, ckpt)  # recipe.resume, and the guard's decisions made since
            return train(training)
    finally:
        if lock is not None:
            lock.release()


def train(run: Run) -> Path:
    """Algorithm 1's outer loop: a GRPO step, its record and completions, a checkpoint every save_every steps."""
    trainer, world, last, nonfinite = run.cfg.trainer, run.world, None, 0
    if world.main:  # the files read as one run: lines of steps after the one resumed from are dropped
        run.log.truncate(run.state.step)
        run.samples.truncate(run.state.step)
    console.print(f"run dir: {run.run_dir}")
    # leaving the block (also on an error) closes the trackers' run, the environment's instances, and puts the
    # signal handlers back
    with progress("train") as bar, run.log, StopFlag() as stop, env_closed(run.sampler):
        task = bar.add_task("train", total=trainer.max_steps, completed=run.state.step, info="")
        while (n := run.state.step + 1) <= trainer.max_steps:  # a guard's rewind sets the step back
            record = step(run, n)
            scores = held_out(run, record) if evaluates(run, n) else {}  # held-out eval, after the update
            nonfinite = nonfinite + 1 if record.nonfinite_skipped else 0
            if record.nonfinite_skipped:
                console.print(f"[yellow]step {n}: non-finite loss or gradient, optimizer step skipped ({nonfinite} "
                              f"in a row; the run stops at trainer.max_nonfinite_steps={trainer.max_nonfinite_steps})")
            log_step(run, record, lambda info: bar.update(task, completed=n, info=info))
            stop.requested = agreed_stop(world, stop.requested)  # a stop asked of any rank stops them all here
            if trip := guard.fired(run):  # a tripwire: back to the last checkpoint that passed, its remedy applied
                run, last, halt = guard.rewind(run, trip)
                nonfinite = 0
                if halt or stop.requested:
                    break
                continue
            if n % trainer.save_every == 0 or n == trainer.max_steps or stop.requested or scores:
                last = save(run, n)  # an eval's step too: its score belongs to a checkpoint on disk
                keep_best(run, n, scores)
            if stop.requested:
                console.print(f"stopped by {stop.requested} after step {n}; checkpoint: {last}\n"
                              f"resume with: grpo train resume={run.run_dir}")
                break
            if nonfinite >= trainer.max_nonfinite_steps:
                raise RunError(f"{nonfinite} steps in a row had a non-finite loss or gradient (last: step {n}); the "
                               f"last good checkpoint is {last or 'none'}: lower optimizer.lr or check the rewards, "
                               f"and start a new run")
    last = last or checkpoint.resolve(run.run_dir)  # resumed at or past max_steps: nothing was done
    console.print(f"checkpoint: {last}\ncurves: {plot_training(run.run_dir) if world.main else None}")
    return last


def log_step(run: Run, record, show) -> None:
    """Step `record.step`'s record in metrics.jsonl and the trackers, its completions (every rank gives its own), the
    progress bar's line (`show(info)`), and dynamic sampling's line when the step's batch fell short."""
    n = record.step
    run.log.log(record.metrics)
    run.samples.log(n, record.kept.positions, record.kept.examples, record.kept.rollout, record.kept.result,
                    record.advantages, run.world)
    show(summary(record.metrics))
    if state := run.keep.state(record.metrics):  # dynamic sampling short of a full batch: a line that stays
        console.print(f"[yellow]step {n}: {state}", highlight=False)


def evaluates(run: Run, n: int) -> bool:
    """Is step n followed by a held-out eval: every trainer.eval_every steps, and the last step whatever its number,
    when the run has problems to score (`run.heldout` is empty with eval off, or eval_size=auto on data without a
    held-out split)."""
    trainer = run.cfg.trainer
    return bool(run.heldout) and (n % trainer.eval_every == 0 or n == trainer.max_steps)


def keep_best(run: Run, n: int, scores: dict) -> None:
    """After the checkpoint of an evaluated step is written: RUN/best.json names it if it scored best so far (held-out
    accuracy; the mean reward where the problems have no reference answers). Rank 0 writes."""
    if not scores or not run.world.main:
        return
    metric = "eval/accuracy" if "eval/accuracy" in scores else "eval/reward"
    checkpoint.record_best(run.run_dir, n, metric, scores[metric], warn=lambda line: console.print(f"[yellow]{line}"))


def summary(metrics: dict) -> str:
    """The progress bar's line for a step."""
    return (f"reward {metrics['reward']:.3f}  kl {metrics['kl']:.4f}  loss {metrics['loss']:+.4f}  "
            f"len {metrics['completions/mean_length']:.0f}")


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
        # sampler=auto picks HF generate here (engine.run_refusal); the server's push gathers a layer at a time
        if not target.startswith("grpo_cli.rollout.hf.") and target not in (AUTO, SERVER):
            errors.append(f"trainer.fsdp=true cannot sample with {target}: its weight push reads whole weights on "
                          f"every rank, which FSDP does not hold; set sampler=vllm_server, sampler=default, or "
                          f"trainer.fsdp=false")
        if cfg.model.quantization:  # FSDP2 would shard bitsandbytes' packed 4-bit weights: never tried
            errors.append(f"trainer.fsdp=true with model.quantization={cfg.model.quantization} is not supported: "
                          f"FSDP sharding of a 4-bit base has not been built or tested; set model.quantization=null "
                          f"(the base sharded in full precision) or trainer.fsdp=false (a 4-bit base on every rank)")
    if size > 1 and cfg.iterative.iterations:
        errors.append(f"iterative RL (iterative.iterations={cfg.iterative.iterations}) runs in one process only "
                      f"for now; launch it without torchrun, or set iterative.iterations=0")
    return errors


def agreed_stop(world: World, requested: str | None) -> str | None:
    """A stop request of any rank, on every rank (so all stop after the same step)."""
    if world.size == 1:
        return requested
    anyone = world.max(torch.tensor([requested is not None], dtype=torch.int64))
    return requested or ("a stop request on another rank" if int(anyone[0]) else None)


class StopFlag:
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
    Rule("trainer.eval_every", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (no held-out eval); set trainer.eval_every=10"),
    Rule("trainer.eval_size", lambda v: v == "auto" or (is_int(v) and v >= 1),
         "must be auto or an integer >= 1; set trainer.eval_size=auto"),
    Rule("trainer.keep_last", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (keep all); set trainer.keep_last=3"),
    Rule("trainer.max_grad_norm", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 or null (no clipping); set trainer.max_grad_norm=1.0"),
    lambda cfg: raised(check_logging)(cfg.trainer),
    lambda cfg: check_world(cfg, world_size()),
    trainable_dtype,
    checkpoint.init_adapter_problems,
    *compiled.CHECKS,
    *guard.CHECKS,
]


if __name__ == "__main__":
    sys.exit(main())
