"""`grpo eval`: accuracy of saved checkpoints (and the base model) on held-out problems.

    grpo eval checkpoint=outputs/train/DATE/TIME eval.include_base=true   # every checkpoint of a run
    grpo eval data=gsm8k data.path=train.jsonl data.limit=50               # the base model
    grpo eval checkpoint=RUN eval.num_samples=8 'eval.k=[1,4,8]'           # + pass@k and maj@k

Per checkpoint: greedy accuracy (pass@1 at temperature 0); with eval.num_samples = n > 0, n
samples per problem at eval.temperature give unbiased pass@k (Chen et al. 2021) and maj@k
(majority vote over the extracted answers of the first k samples). Accuracy, pass@k and maj@k count
the problems that have a reference `answer`; the mean reward counts every completion, so a dataset
of open prompts (`data=hf` without an answer column) is reported by its mean reward alone. Problems come from the
dataset's held-out split, never the training stream. Writes eval.json, eval_samples.jsonl (one line
per checkpoint and problem) and, for more than one checkpoint, accuracy.png.

Rerunning in the same folder reuses a row only if it was made the same way: each row carries a
digest of the problem, the model section, the adapter file's bytes, the reward, the sampler and
eval's generation settings. Rows made otherwise are not reported under the new settings: the old
files move to `stale-TIME/` in the folder and those rows are recomputed. A checkpoint whose files
are missing or corrupt is skipped with one warning line naming the file.

With `env=tools` or `class` (or a run trained with one) every completion is a multi-turn episode, sampled as
training samples them; its turns go into eval_samples.jsonl.

Under torchrun each rank evaluates every N-th problem still to do and rank 0 gathers the rows and
writes the files (its own rows as they come, the others' at the end of each checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.table import Table

from grpo_cli import checkpoint, files
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.checks import Check, Rule, is_int, is_num
from grpo_cli.components import assemble
from grpo_cli.distributed import World, init_world
from grpo_cli.errors import ConfigError
from grpo_cli.evaluation import score_batch, summarize
from grpo_cli.inference import inference_config, inference_policy, named_pick, take_checkpoint
from grpo_cli.metrics.console import console, progress, quiet
from grpo_cli.metrics.stats import mean
from grpo_cli.policy import adapter_enabled
from grpo_cli.rollout.episodes import env_closed
from grpo_cli.rollout.sizing import Job


@hydra_app("eval")
def main(cfg: DictConfig) -> None:
    run(cfg, Path(HydraConfig.get().runtime.output_dir), command_line_overrides())


def expand_checkpoints(spec) -> list[Path | None]:
    """`checkpoint=` as given: null (base model), a checkpoint, a run folder (all of its), RUN/best or RUN/last (that
    one, said in one line: inference.pick) or a list.

    A run folder gives every checkpoints/step_N folder, complete or not: `usable` says which fail. Unlike export and
    sample, which take one checkpoint of a run (its best), eval ranks them all, and marks the recorded best.
    """
    if spec is None:
        return [None]
    items = list(spec) if isinstance(spec, (list, ListConfig)) else [spec]
    out: list[Path | None] = []
    for item in items:
        path = Path(str(item))
        if named_pick(path):
            out.append(take_checkpoint(path))
            continue
        if not path.exists():
            raise ConfigError(f"checkpoint={path} does not exist; pass a checkpoint or run folder from `grpo train`")
        if (path / "trainer_state.json").exists() or checkpoint.step_of(path) is not None:
            out.append(path)
            continue
        found = [p for p in (path / "checkpoints").glob("step_*") if p.is_dir() and checkpoint.step_of(p) is not None]
        if not found:
            raise ConfigError(f"{path} holds no checkpoints/step_* folders; pass a run folder of `grpo train`")
        out.extend(sorted(found, key=checkpoint.step_of))
    return out


def usable(checkpoints: list[Path | None]) -> dict[Path | None, int | None]:
    """The checkpoints whose files all read (checkpoint.verify), with their steps; None (the base
    model) always. Each one that fails is skipped with a warning line naming its file; if every
    checkpoint asked for fails, that is an error (one line each)."""
    steps: dict[Path | None, int | None] = {}
    problems = []
    for ckpt in checkpoints:
        if ckpt is None:
            steps[None] = None
            continue
        try:
            checkpoint.verify(ckpt)
        except ConfigError as err:
            problems.append(f"{ckpt}: {err}")
            continue
        state = json.loads((ckpt / "trainer_state.json").read_text())
        step = state.get("step") if isinstance(state, dict) else None
        steps[ckpt] = step if isinstance(step, int) else checkpoint.step_of(ckpt)
    if problems and not any(c is not None for c in steps):
        raise ConfigError("\n".join(problems))
    for problem in problems:
        _warn(f"skipping {problem}")
    return steps


def _warn(line: str) -> None:
    # soft_wrap: one line however narrow the terminal; markup off: paths may hold [brackets]
    console.print(f"warning: {line}", style="yellow", markup=False, highlight=False, soft_wrap=True)


def run(cfg: DictConfig, out_dir: Path, overrides: list[str] = ()) -> dict:
    world = init_world()
    with quiet(not world.main):  # one rank speaks
        return _evaluate(cfg, out_dir, overrides, world)


def _evaluate(cfg: DictConfig, out_dir: Path, overrides: list[str], world: World) -> dict:
    eval_cfg = cfg.eval
    steps = usable(expand_checkpoints(cfg.checkpoint))
    checkpoints = list(steps)
    if eval_cfg.include_base and None not in checkpoints:
        checkpoints = [None, *checkpoints]
    cfg = inference_config(cfg, list(overrides), checkpoints, CHECKS)
    # the data, the environment (or the run's own: episodes, as train runs them) and the reward before the model: a
    # bad path, column or function stops here; and which engine samples
    parts = assemble(cfg, "eval")
    data, reward_fn = parts.data, parts.reward
    policy, tokenizer = inference_policy(cfg)
    parts.template(tokenizer)
    # eval.json and the rows' digests say what sampled; an engine is sized for one scoring batch
    sampler, cfg.sampler = parts.start(policy, Job(eval_cfg.batch_size, max(1, eval_cfg.num_samples),
                                                   eval_cfg.max_new_tokens))
    # eval.limit caps the held-out problems; data.limit (when set) caps them too, as users expect
    limits = [n for n in (eval_cfg.limit, cfg.data.get("limit")) if n]
    problems = list(data.heldout)[: min(limits)] if limits else list(data.heldout)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path = out_dir / "eval_samples.jsonl"
    settings = _settings(cfg)
    # the digest each row must carry to be reused: (checkpoint, problem index) -> digest
    wanted = {}
    for ckpt in checkpoints:
        adapter = _file_digest(checkpoint.weights_file(ckpt)) if ckpt is not None else None
        name = str(ckpt) if ckpt else None
        wanted.update({(name, i): _digest(settings, adapter, p) for i, p in enumerate(problems)})
    done = world.broadcast(_reuse(out_dir, wanted) if world.main else None)  # rank 0 alone moves stale files

    results = []
    # the environment's instances closed when the scoring ends, not when the collector finds them
    with env_closed(sampler):
        for ckpt in checkpoints:
            name = str(ckpt) if ckpt else None
            if ckpt is not None:
                checkpoint.load_weights(policy, ckpt)
            rows = [done[(name, i)] for i in range(len(problems)) if (name, i) in done]
            todo = [i for i in range(len(problems)) if (name, i) not in done][world.rank::world.size]
            with (progress(f"eval {Path(name).name if name else 'base'}") as bar,
                  samples_path.open("a") if world.main else open(os.devnull, "w") as out):
                task = bar.add_task("", total=len(rows) + len(todo), completed=len(rows), info="")  # this rank's share
                for start in range(0, len(todo), eval_cfg.batch_size):
                    batch = [problems[i] for i in todo[start:start + eval_cfg.batch_size]]
                    # deterministic for a fixed seed, whatever was skipped
                    generator = torch.Generator().manual_seed(eval_cfg.seed + todo[start])
                    with adapter_enabled(policy, ckpt is not None):
                        new = score_batch(policy, tokenizer, sampler, reward_fn, batch, eval_cfg, generator)
                    for i, row in zip(todo[start:start + eval_cfg.batch_size], new):
                        row.update(checkpoint=name, index=i, digest=wanted[(name, i)])
                        out.write(json.dumps(row) + "\n")
                        rows.append(row)
                    graded = [r["correct"] for r in rows if r["correct"] is not None]  # rows with a reference answer
                    info = (f"acc {mean(graded):.3f}" if graded
                            else f"reward {mean(r['greedy']['reward'] for r in rows):.3f}")
                    bar.update(task, completed=len(rows), info=info)
                if world.size > 1:  # the other ranks' new rows, written by rank 0
                    new = [r for r in rows if (name, r["index"]) not in done]
                    others = [r for rank, part in enumerate(world.gather(new)) if rank != world.rank for r in part]
                    for row in others:
                        out.write(json.dumps(row) + "\n")
                    rows += others
            results.append(summarize(name, steps.get(ckpt), rows, eval_cfg))
    mark_best(results)
    report = {"results": results, "config": OmegaConf.to_container(cfg, resolve=True)}
    if not world.main:
        return report
    files.write_text(out_dir / "eval.json", json.dumps(report, indent=1))  # a kill leaves the earlier one whole
    console.print(results_table(results))
    if len(results) > 1:
        plot_accuracy(results, out_dir / "accuracy.png")
        console.print(f"plot: {out_dir / 'accuracy.png'}")
    console.print(f"results: {out_dir / 'eval.json'}")
    return report


def mark_best(results: list[dict]) -> None:
    """Each result's `best`: its checkpoint is the one its run's best.json names (checkpoint.best_checkpoint), the
    checkpoint that export and sample take for checkpoint=RUN."""
    for r in results:
        path = Path(r["checkpoint"]) if r["checkpoint"] else None
        in_run = path is not None and checkpoint.step_of(path) is not None
        best = checkpoint.best_checkpoint(path.parent.parent) if in_run else None  # None: no evals, or unreadable
        r["best"] = best is not None and best.resolve() == path.resolve()


def results_table(results: list[dict]) -> Table:
    marked = any(r.get("best") for r in results)
    table = Table(title="grpo eval", caption="(best): the run's best checkpoint by its evals in training (best.json), "
                  "the one export and sample take for checkpoint=RUN" if marked else None)
    keys = sorted({k for r in results for k in r.get("pass@k", {})}, key=int)
    for col in ["checkpoint", "step", "problems", "accuracy", *[f"pass@{k}" for k in keys],
                *[f"maj@{k}" for k in keys], "reward", "length", "truncated"]:
        table.add_column(col, justify="left" if col == "checkpoint" else "right",
                         overflow="fold")  # a narrow terminal wraps the path instead of cutting it
    for r in results:
        table.add_row(_label(r["checkpoint"]) + (" (best)" if r.get("best") else ""),
                      str(r["step"] if r["step"] is not None else "-"),
                      str(r["num_problems"]), "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}",
                      *[f"{r['pass@k'][k]:.3f}" for k in keys], *[f"{r['maj@k'][k]:.3f}" for k in keys],
                      f"{r['mean_reward']:.3f}", f"{r['mean_length']:.1f}", f"{r['truncation_rate']:.2f}")
    return table


def _label(checkpoint_path: str | None) -> str:
    """`RUN/step_NNNNNN` (the run folder's name tells sweep jobs apart), or `base`."""
    if checkpoint_path is None:
        return "base"
    path = Path(checkpoint_path)
    return f"{path.parent.parent.name}/{path.name}"


def plot_accuracy(results: list[dict], path: Path) -> None:
    """PATH (accuracy.png): the greedy accuracy (and pass@k) of each run's checkpoints against the step, the base
    model at step 0. Drawn once: matplotlib's object API (no pyplot, no process-wide backend) and margins fixed in
    inches, where tight_layout measured the figure and left it a layout engine, for which savefig drew it again."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # a dataset without reference answers has no accuracy: its mean reward is plotted instead
    key = "accuracy" if any(r["accuracy"] is not None for r in results) else "mean_reward"
    base = [r for r in results if r["checkpoint"] is None]
    runs: dict[str, list[dict]] = {}  # one line per run folder, in step order
    for r in results:
        if r["checkpoint"] is not None:
            runs.setdefault(str(Path(r["checkpoint"]).parent.parent), []).append(r)
    width, height = 6.0, 4.0
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # the PNG renderer, attached to this figure only (fig.canvas)
    # inches: y tick labels and the y label at the left, x tick labels and the x label below
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.55 / height, top=1 - 0.15 / height)
    ax = fig.subplots()
    for run, rows in runs.items():
        rows = base + sorted(rows, key=lambda r: r["step"])  # the base model is step 0 of every run
        name = "" if len(runs) == 1 else f"{Path(run).name}: "
        steps = [r["step"] or 0 for r in rows]
        ax.plot(steps, [r[key] for r in rows], marker="o", label=f"{name}greedy {key.replace('_', ' ')}")
        for k in rows[0].get("pass@k", {}):
            ax.plot(steps, [r["pass@k"][k] for r in rows], marker=".", linestyle="--", label=f"{name}pass@{k}")
    ax.set_xlabel("training step (0 = base model)")
    ax.set_ylabel(f"held-out {key.replace('_', ' ')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)  # no figure registry to close it in: it goes with its last reference


# eval's settings that change a row (eval.limit, eval.k and eval.include_base only pick rows or summarize them)
_ROW_SETTINGS = ("num_samples", "temperature", "max_new_tokens", "seed", "batch_size")


def _settings(cfg: DictConfig) -> dict:
    """What, besides the problem and the adapter, decides a row: the base model, reward, sampler and
    eval's generation settings (batch_size too: it sets the seeds and the padding of each batch)."""
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "reward", "sampler")}
    if OmegaConf.select(cfg, "env._target_"):  # episodes' rows are made with their tools and limits
        plain["env"] = OmegaConf.to_container(cfg.env, resolve=True)
    return {**plain, "eval": {k: cfg.eval[k] for k in _ROW_SETTINGS}}


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    """The adapter's bytes: a run folder trained again under the same path is another model."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _reuse(out_dir: Path, wanted: dict) -> dict:
    """Rows of an earlier eval in `out_dir` that carry the digest this eval wants, by (checkpoint, index).

    If the files hold other rows for the same checkpoints and problems (other data, reward, sampler,
    eval settings or weights, or a line cut short by a crash), they move whole to `stale-TIME/` (one
    warning line says where) and eval_samples.jsonl starts again from the reusable rows.
    """
    path = out_dir / "eval_samples.jsonl"
    if not path.exists():
        return {}
    done, stale = {}, 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            key = (row["checkpoint"], row["index"])
        except (ValueError, TypeError, KeyError):  # a line cut short by a kill, or not ours
            stale += line.strip() != ""
            continue
        if key not in wanted:
            continue  # another checkpoint or a problem past eval.limit: neither reused nor in the way
        if row.get("digest") == wanted[key]:
            done[key] = row
        else:
            stale += 1
    if stale:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, n = out_dir / f"stale-{stamp}", 1
        while aside.exists():  # two reruns within a second must not overwrite each other's old files
            aside, n = out_dir / f"stale-{stamp}-{n}", n + 1
        aside.mkdir()
        for name in ("eval_samples.jsonl", "eval.json", "accuracy.png"):
            if (out_dir / name).exists():
                (out_dir / name).rename(aside / name)
        files.write_text(path, "".join(json.dumps(row) + "\n" for row in done.values()))
        _warn(f"{stale} rows of {path} were made with other data, reward, sampler, eval settings or weights; "
              f"the old files moved to {aside}, {len(done)} matching rows are reused and the rest recomputed")
    return done

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _enough_samples(cfg: DictConfig) -> list[str]:
    ks, samples = cfg.eval.k, cfg.eval.num_samples
    ints = is_int(samples) and isinstance(ks, ListConfig) and all(is_int(k) for k in ks)
    if ints and samples and ks and max(ks) > samples:
        return [f"eval.k ({list(ks)}) asks for more samples than eval.num_samples ({samples}); "
                f"set eval.num_samples={max(ks)}"]
    return []


# the eval section's checks, which `run` hands to config.validate beside every library module's
CHECKS: list[Check] = [
    Rule("eval.limit", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (all); set eval.limit=200"),
    Rule("eval.batch_size", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set eval.batch_size=32"),
    Rule("eval.num_samples", lambda v: is_int(v) and v >= 0,
         "must be an integer >= 0 (0: greedy only); set eval.num_samples=0"),
    Rule("eval.k", lambda v: isinstance(v, ListConfig) and len(v) > 0 and all(is_int(k) and k >= 1 for k in v),
         "must be a list of integers >= 1; set eval.k=[1,4]"),
    Rule("eval.temperature", lambda v: is_num(v) and v > 0, "must be > 0; set eval.temperature=1.0"),
    Rule("eval.max_new_tokens", lambda v: v is None or (is_int(v) and v >= 1),
         "must be an integer >= 1 or null (sampler.max_new_tokens); set eval.max_new_tokens=null"),
    Rule("eval.seed", lambda v: is_int(v) and v >= 0, "must be an integer >= 0; set eval.seed=0"),
    Rule("eval.include_base", lambda v: isinstance(v, bool), "must be true or false; set eval.include_base=false"),
    _enough_samples,
]
