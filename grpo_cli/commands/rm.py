"""`grpo rm`: train an outcome (ORM) or process (PRM) reward model, from a labeled JSONL or from the
policy's own samples, and report its held-out accuracy and AUCs (pooled, within prompt).

    grpo rm                                                    # base SmolLM2 samples arithmetic, ORM
    grpo rm checkpoint=outputs/train/DATE/TIME                 # sample from a trained policy instead
    grpo rm rm.labeled=rows.jsonl                              # train on labeled rows (outcome or process)
    grpo rm data=gsm8k data.path=train.jsonl sampler=default labeler=mc      # PRM, Math-Shepherd labels
    grpo rm rm.init=outputs/rm/DATE/TIME/model rm.replay.folder=replay      # continue, 10% replay
    grpo train reward=orm reward.name_or_path=outputs/rm/DATE/TIME/model    # use it

Steps: sample `rm.samples_per_problem` completions on `rm.num_problems` training problems of `data`
(the policy as `grpo sample` loads it) -> label them (`labeler`: outcome, mc, verifier) -> hold out
the rows of a share of the prompts -> mix in replayed rows of earlier iterations (`rm.replay`) ->
score the held-out rows with the starting model (a new head, or `rm.init`) -> train (LoRA + head,
binary cross-entropy) -> score them again -> merge and save.

Writes into the run folder: `model/` (the reward model: safetensors + tokenizer + rm.json),
`labeled.jsonl` (this run's new rows, each with its split), `rm_eval.json` (held-out metrics before
and after training, row counts, replay counts). The library pieces live in
`grpo_cli.rm`; the paper's iterations (sample, relabel, retrain with replay, reset the
reference) run inside `grpo train` (iterative.iterations, grpo_cli/iterative.py) with the same pieces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from grpo_cli import checkpoint
from grpo_cli import rm as training
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.checks import Check, raised
from grpo_cli.config import validate
from grpo_cli.errors import ConfigError
from grpo_cli.inference import inherit, load_inference, take_checkpoint
from grpo_cli.instantiate import build
from grpo_cli.metrics.console import console, progress
from grpo_cli.policy import adapter_enabled, resolve_device, resolve_dtype, trainable_dtype
from grpo_cli.rewards.models import check_classifier
from grpo_cli.runs import read_saved


@hydra_app("rm")
def main(cfg: DictConfig) -> None:
    run(cfg, Path(HydraConfig.get().runtime.output_dir), command_line_overrides())


def check_settings(rm_cfg: DictConfig) -> None:
    """The rm section's values, each error naming the fix (before any model loads)."""
    training.check_settings(rm_cfg)  # the settings grpo train's iterations share (conf/rm/default.yaml)
    iteration = rm_cfg.replay.iteration
    if iteration is not None and (not isinstance(iteration, int) or iteration < 0):
        raise ConfigError(f"rm.replay.iteration ({rm_cfg.replay.iteration!r}) must be an integer >= 0 or null (the "
                          f"next after the folder's last); set rm.replay.iteration=null")


def run(cfg: DictConfig, out_dir: Path, overrides: list[str] = ()) -> dict:
    """Train a reward model as `cfg` says, writing into `out_dir`; returns what rm_eval.json holds."""
    started = time.time()
    validate(cfg, *CHECKS)  # the rm section's values first: one line each, before any file is read
    rm_cfg = cfg.rm
    labeler = None
    if rm_cfg.labeled:
        rows, kind = training.read_labeled(rm_cfg.labeled)
    else:
        labeler = build(cfg.labeler)
        kind = labeler.kind
    if rm_cfg.init:
        if not Path(str(rm_cfg.init)).is_dir():
            raise ConfigError(f"rm.init={rm_cfg.init} is not a folder; "
                              f"pass the RUN/model folder of an earlier `grpo rm`")
        check_classifier(str(rm_cfg.init), training.AUTO_CLASS[kind])
    # a run folder's best checkpoint (its evals recorded one), else its newest; RUN/best, RUN/last
    ckpt = take_checkpoint(cfg.checkpoint) if cfg.checkpoint and not rm_cfg.labeled else None
    if ckpt is not None:  # sample from a trained policy: its model, data and sampler unless overridden

        sections = ["model", "data", "sampler"]  # data, not code: runs.check_saved
        saved = OmegaConf.masked_copy(read_saved(ckpt, sections, list(overrides), cfg.trust_run_config), sections)
        cfg = inherit(cfg, saved, list(overrides))
    validate(cfg, *CHECKS)
    rm_cfg = cfg.rm
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)

    if not rm_cfg.labeled:
        rows = sample_and_label(cfg, ckpt, labeler, overrides)
        if not rows:
            raise ConfigError("the labeler kept no rows (no reference answers, or no step it could label); "
                              "check data and labeler, or pass rm.labeled=FILE")
        kind = training.check_rows(rows, "labeled samples")

    train_rows, heldout = training.split_heldout(rows, rm_cfg.heldout_fraction, rm_cfg.seed)
    replay = None
    if rm_cfg.replay.folder:
        replay = training.ReplayBuffer(rm_cfg.replay.folder, rm_cfg.replay.share, rm_cfg.seed)
        iteration = rm_cfg.replay.iteration if rm_cfg.replay.iteration is not None else replay.next_iteration()
        train_rows, replay_info = replay.mix(iteration, train_rows)
    else:
        replay_info = {"iteration": None, "new": len(train_rows), "replay": 0}
    if not train_rows:
        raise ConfigError("no rows left to train on; add rows or lower rm.heldout_fraction")

    model, tokenizer = starting_model(cfg, kind, device, dtype)
    with progress(f"train {'ORM' if kind == 'outcome' else 'PRM'}") as bar:
        task = bar.add_task("", total=rm_cfg.epochs * len(train_rows), info="")

        def advance(done: int, loss: float) -> None:
            bar.update(task, advance=done, info=f"loss {loss:.3f}")

        model, trained = training.retrain(model, tokenizer, train_rows, heldout, rm_cfg, kind, advance=advance)
    after = trained["heldout_after"]
    report = {
        "kind": kind, "model": str(out_dir / "model"), "init": rm_cfg.init,
        "rows": {"labeled": len(rows), "train_new": replay_info["new"], "train_replay": replay_info["replay"],
                 "heldout": len(heldout), "heldout_prompts": len({r["prompt"] for r in heldout})},
        "replay": replay_info, **trained, "seconds": round(time.time() - started, 1),
    }
    training.save_reward_model(model, tokenizer, out_dir / "model", {
        "kind": kind, "template": rm_cfg.template, "pattern": cfg.labeler.get("pattern") if labeler else None,
        "base": cfg.model.get("name"), "heldout": after, "rows": report["rows"]})
    held = {r["prompt"] for r in heldout}
    training.write_jsonl(out_dir / "labeled.jsonl", [{**r, "split": "heldout" if r["prompt"] in held else "train"}
                                              for r in rows])
    if replay is not None:  # only after training succeeded, so a failed run leaves the buffer as it was
        replay.add(replay_info["iteration"], rows)
    report["config"] = OmegaConf.to_container(cfg, resolve=True)
    (out_dir / "rm_eval.json").write_text(json.dumps(report, indent=1))
    console.print(results_table(report))
    option = "reward=orm" if kind == "outcome" else "reward=prm"
    # soft_wrap: paths and the command stay on one line, to copy
    folder = out_dir / "model"
    console.print(f"reward model: {folder}\nuse it: grpo train {option} reward.name_or_path={folder}", soft_wrap=True)
    return report


def sample_and_label(cfg: DictConfig, ckpt: Path | None, labeler, overrides) -> list[dict]:
    """Completions of the policy (checkpoint or base) on seeded training problems, labeled."""
    rm_cfg = cfg.rm
    policy, tokenizer, _ = load_inference(cfg, list(overrides), [])
    if ckpt is not None:
        checkpoint.load_weights(policy, ckpt)
    problems = training.pick_problems(build(cfg.data).train, rm_cfg.num_problems, rm_cfg.seed)
    sampler = build(cfg.sampler)
    torch.manual_seed(rm_cfg.seed)
    with adapter_enabled(policy, ckpt is not None):
        with progress("sample") as bar:
            task = bar.add_task("", total=len(problems), info="")
            samples = training.draw_samples(policy, tokenizer, sampler, problems, rm_cfg.samples_per_problem,
                                     rm_cfg.prompts_per_batch, advance=lambda n: bar.update(task, advance=n))
        with progress(f"label ({type(labeler).__name__})") as bar:
            task = bar.add_task("", total=None, info="")
            rows = labeler(samples, policy=policy, tokenizer=tokenizer, sampler=sampler,
                           advance=lambda n: bar.update(task, advance=n))
            bar.update(task, total=1, completed=1, info=f"{len(rows)} rows from {len(samples)} samples")
    del policy
    return rows


def starting_model(cfg: DictConfig, kind: str, device, dtype):
    """(model, tokenizer): `rm.init` loaded, or a new head on the base weights of `model`."""
    return training.starting_classifier(cfg.rm.init, kind, cfg.model.loader, device, dtype, seed=cfg.rm.seed)


def results_table(report: dict) -> Table:
    unit = "rows" if report["kind"] == "outcome" else "steps"
    table = Table(title=f"grpo rm: {report['kind']} reward model, held-out {unit} "
                        f"({report['rows']['heldout_prompts']} prompts it did not train on)")
    for col in ("model", "labels", "positives", "accuracy", "AUC", "AUC in prompt (prompts)", "BCE", "mean score"):
        table.add_column(col, justify="left" if col == "model" else "right")
    start = "start (rm.init)" if report["init"] else "start (new head)"
    for name, m in ((start, report["heldout_before"]), ("trained", report["heldout_after"])):
        if m is None:
            table.add_row(name, "0", "-", "-", "-", "-", "-", "-")
            continue
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        table.add_row(name, str(m["labels"]), str(m["positives"]), fmt(m["accuracy"]), fmt(m["auc"]),
                      f"{fmt(m['auc_within_prompt'])} ({m['auc_prompts']})", fmt(m["loss"]), fmt(m["mean_score"]))
    rows = report["rows"]
    table.caption = (f"trained on {rows['train_new']} new + {rows['train_replay']} replayed rows; "
                     f"accuracy at score 0.5, a label >= 0.5 counts as positive; AUC in prompt: among each prompt's "
                     f"own samples (the ranking GRPO uses), over the prompts with both labels")
    return table


# the rm section's checks, which `run` hands to config.validate beside every library module's
CHECKS: list[Check] = [lambda cfg: raised(check_settings)(cfg.rm), trainable_dtype]
