"""Load a trained run for eval, sample, export and rm: the saved config, the policy, its checkpoints, and which
checkpoint `checkpoint=RUN`, `RUN/best` or `RUN/last` takes (`pick`).

Above policy, checkpoint and config: a checkpoint's saved config fills in the sections the command
line leaves alone (`inherit`), and every checkpoint must fit the base model built here.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_cli import checkpoint
from grpo_cli.config import validate
from grpo_cli.errors import CheckpointError, ConfigError
from grpo_cli.metrics.console import console
from grpo_cli.policy import build_policy
from grpo_cli.runs import read_saved, upgrade

# what a checkpoint's config.yaml supplies to eval and sample unless the command line says otherwise (env: a run
# trained with tools is evaluated with them)
INHERITED = ("model", "data", "reward", "sampler", "env")


def inherit(cfg: DictConfig, saved: DictConfig, overrides: list[str]) -> DictConfig:
    """`cfg` with the model/data/reward/sampler/env sections of a checkpoint's `saved` config.

    A group override on the command line (`data=gsm8k`) keeps the composed section; dotted
    overrides (`data.limit=50`) are applied on top of the saved section. A different base model is
    an error: a LoRA adapter only fits the weights it was trained on. The reward of an iterative run
    is not inherited here: its reward model was retrained at every iteration (RUN/rm/iteration_NNN),
    so its saved section names none; eval and sample score with the last one (`inference_config`).
    """
    cfg = cfg.copy()
    iterative = bool(OmegaConf.select(saved, "iterative.iterations", default=0))
    for section in INHERITED:
        if section not in saved or (section == "reward" and iterative):
            continue
        group_override = any(o.lstrip("+~").split("=")[0] == section for o in overrides)
        if section == "model" and group_override and cfg.model.get("name") != saved.model.get("name"):
            raise ConfigError(f"model {cfg.model.get('name')!r} was requested but the checkpoint was trained on "
                              f"{saved.model.get('name')!r}; drop the model= override")
        if group_override:
            continue
        merged = saved[section].copy()
        dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith(section + ".")]
        if dotted:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotted)[section])
        cfg[section] = merged
    return cfg



def _iterative_reward(cfg: DictConfig, saved: DictConfig, ckpt: Path, overrides: list[str]) -> DictConfig:
    """An iterative run's saved reward names no model (each iteration retrained one, in RUN/rm/iteration_NNN):
    unless the command line picks a reward, its last reward model scores, said in one line; a run that saved
    none yet is scored by the command's own reward, also said."""
    if not OmegaConf.select(saved, "iterative.iterations", default=0) or "reward" not in saved \
            or any(o.lstrip("+~").split("=")[0] == "reward" for o in overrides):
        return cfg
    run_dir = ckpt.parent.parent if checkpoint.step_of(ckpt) is not None else ckpt
    models = sorted(p for p in (run_dir / "rm").glob("iteration_*") if (p / "config.json").is_file())
    if not models:
        _say(f"reward: {run_dir} retrained its reward model at each iteration and saved none yet; scoring with "
             f"this command's reward ({cfg.reward.get('_target_')}); pass reward=... to choose another")
        return cfg
    cfg = cfg.copy()
    cfg.reward = saved.reward.copy()
    cfg.reward.name_or_path = str(models[-1])
    dotted = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith("reward.")]
    if dotted:
        cfg.reward = OmegaConf.merge(cfg.reward, OmegaConf.from_dotlist(dotted).reward)
    _say(f"reward: {run_dir} retrained its reward model at each iteration; scoring with the last one, {models[-1]} "
         f"(pass reward=... to choose another)")
    return cfg


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def warn(line: str) -> None:
    console.print(f"warning: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True)


# `checkpoint=RUN/best` and `checkpoint=RUN/last`: names after a run folder, not folders in it
PICKS = ("best", "last")


def named_pick(path: str | Path) -> tuple[Path, str] | None:
    """(RUN, "best" or "last") when `path` is RUN/best or RUN/last (and no such folder exists), else None."""
    path = Path(path)
    return (path.parent, path.name) if path.name in PICKS and not os.path.lexists(path) else None


def pick(path: str | Path, *, warn=None) -> tuple[Path, str | None]:
    """The checkpoint that a command reading one (export, sample, rm) takes for `checkpoint=PATH`, and why in words
    (None: a checkpoint folder, taken as given):

        RUN/best   the best recorded by the run's evals (best.json); a run without one is an error naming RUN/last
        RUN/last   the newest checkpoint whose files read (`resolve`)
        RUN        the best when the run recorded one that reads, else the newest: a run that evaluated itself
                   during training has said which checkpoint generalizes best, and the newest may have drifted past it

    `warn(line)`: a damaged newer checkpoint passed over, or a best.json that RUN cannot use.
    """
    named = named_pick(path)
    if named is None:
        if (Path(path) / "trainer_state.json").exists():
            return checkpoint.resolve(path), None
        run_dir, which = Path(path), None
    else:
        run_dir, which = named
    if which == "last":
        return checkpoint.resolve(run_dir, warn=warn), "the newest, as RUN/last asks"
    if which == "best":
        record = checkpoint.read_best(run_dir)
        if record is None:
            checkpoint.resolve(run_dir)  # not a run folder, or none of its checkpoints reads: that error first
            raise CheckpointError(f"{path}: the run has no evals (no best.json: it trained without "
                                  f"trainer.eval_every), so no best checkpoint; pass {run_dir}/last or {run_dir} for "
                                  f"its newest")
        ckpt = checkpoint.checkpoint_dir(run_dir, record["step"])
        if not ckpt.is_dir():
            raise CheckpointError(f"{path}: {run_dir / checkpoint.BEST} names {ckpt.name}, which is gone from "
                                  f"{ckpt.parent}; pass {run_dir}/last for the newest")
        checkpoint.verify(ckpt)
        return ckpt, f"the best by {record['metric']} {record['score']:.4g}"
    best = checkpoint.best_checkpoint(run_dir, warn=warn)
    if best is None:
        why = "no best.json it can use" if os.path.lexists(run_dir / checkpoint.BEST) else "no evals to pick a best by"
        return checkpoint.resolve(run_dir, warn=warn), f"the newest; the run has {why}"
    record = checkpoint.read_best(run_dir)
    newest = checkpoint.list_checkpoints(run_dir)[-1] == best
    return best, (f"the best by {record['metric']} {record['score']:.4g}"
                  f"{', and the newest' if newest else '; RUN/last takes the newest'}")


def take_checkpoint(spec) -> Path:
    """The checkpoint that export, sample and rm read for `checkpoint=SPEC` (`pick`: RUN/best, RUN/last, or
    a run folder's best, else its newest), said in one console line when it was a choice. A damaged newer checkpoint
    passed over, or a best.json the run cannot use, is one warning line."""
    ckpt, why = pick(str(spec), warn=warn)
    say_checkpoint(ckpt, why)
    return ckpt


def say_checkpoint(ckpt: Path, why: str | None) -> None:
    """The line naming the checkpoint a command took and why (`pick`); none for one given as a folder."""
    if why:
        _say(f"checkpoint: {ckpt} ({why})")


# loader options that say where files are cached, not which weights load
_NOT_IDENTITY = ("cache_dir",)


def _base_identity(model_cfg) -> dict:
    """{dotted key: value} of what decides the weights under a LoRA adapter and the adapter's shape."""
    loader = OmegaConf.to_container(model_cfg.loader, resolve=True)
    out = {f"loader.{k}": v for k, v in loader.items() if k not in _NOT_IDENTITY}
    out["finetune"] = model_cfg.finetune
    if out["finetune"] == "full":  # every weight is in the checkpoint: no adapter shape to agree on
        return out
    lora = model_cfg.lora
    out.update({f"lora.{k}": OmegaConf.to_container(lora[k]) if OmegaConf.is_list(lora[k]) else lora[k]
                for k in ("r", "alpha", "target_modules") if k in lora})  # lora.dropout is off in eval
    return out


def load_inference(cfg, overrides: list[str], checkpoints: list, checks: tuple = ()):
    """(policy with LoRA in eval mode, tokenizer, effective config) for eval and sample: `inference_config`,
    then `inference_policy`."""
    cfg = inference_config(cfg, overrides, checkpoints, checks)
    return (*inference_policy(cfg), cfg)


def inference_policy(cfg):
    """(policy with LoRA in eval mode, tokenizer) of an effective config."""
    policy, tokenizer, _ = build_policy(cfg.model)
    policy.eval()
    return policy, tokenizer


def inference_config(cfg, overrides: list[str], checkpoints: list, checks: tuple = ()) -> DictConfig:
    """The effective config of eval and sample, validated: a command builds its data and reward from it before
    the model loads (`inference_policy`), so that a bad path, column or reward function stops it in seconds.

    The first checkpoint's saved config fills in model/data/reward/sampler/env unless the command line
    overrides them (an iterative run's reward: its last reward model,
    `_iterative_reward`). Every checkpoint must have been trained on the model built here: the same
    `model.loader` node (which weights load) and the same LoRA shape, or its adapter would not fit
    or, worse, fit other weights silently.
    """
    first = next((c for c in checkpoints if c is not None), None)
    if first is not None:
        # data, not code: only grpo_cli's own components unless trust_run_config=true (runs.check_saved)
        saved = read_saved(first, INHERITED, overrides, cfg.trust_run_config)
        cfg = inherit(cfg, saved, overrides)
        cfg = _iterative_reward(cfg, saved, Path(first), overrides)
        ours = _base_identity(cfg.model)
        for ckpt in (c for c in checkpoints if c is not None):
            theirs = _base_identity(upgrade(checkpoint.load_config(ckpt)).model)
            key = next((k for k in sorted(ours.keys() | theirs.keys()) if ours.get(k) != theirs.get(k)), None)
            if key is not None:
                raise ConfigError(f"{ckpt} was trained with model.{key}={theirs.get(key)!r}, not {ours.get(key)!r}: "
                                  f"its adapter fits only that base model; drop the model override, or evaluate "
                                  f"checkpoints of different base models apart")
    validate(cfg, *checks)  # the command's own checks (its section) beside the library's
    return cfg

