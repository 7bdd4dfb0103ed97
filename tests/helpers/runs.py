"""The tiny training job (2 prompts x G=4, 8 tokens, a digit reward the random model sometimes earns), samplers'
settings as the YAML composes them, readers and copies of a run's files, labeled rows and JSONL files."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from grpo_cli import recipe
from grpo_cli.commands import train as train_command
from grpo_cli.config import compose, validate
from grpo_cli.distributed import SINGLE
from grpo_cli.rollout.engine import choose

# ---- samplers built by hand -----------------------------------------------------------------------------------------

@functools.cache
def _sampler_section(option: str) -> dict:
    section = OmegaConf.to_container(compose("train", [f"sampler={option}"]).sampler, resolve=True)
    return {k: v for k, v in section.items() if not k.startswith("_")}


def sampler_settings(option: str = "default", **overrides) -> dict:
    """The keyword arguments of conf/sampler/OPTION.yaml's sampler as a command composes them, `overrides` on top:
    a test that builds a sampler by hand names only the values it is about
    (`HFSampler(**sampler_settings(max_new_tokens=8))`), and the YAML stays the settings' one home."""
    return {**_sampler_section(option), **overrides}


# ---- the tiny run: 2 prompts x G=4, 8 tokens, a digit reward that the random model sometimes earns ----------------

DIGIT_REWARD = ("+reward.functions.digit={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,"
                "pattern:'[0-9]'}")
# held-out eval (trainer.eval_every) and the guard (trainer.guard) off: a test about one turns it on
TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=4", "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4", "optimizer.lr=0.05", "trainer.warmup_steps=0", "trainer.report_to=[]",
        "trainer.eval_every=null", "trainer.guard=null", DIGIT_REWARD, "+reward.weights.digit=1.0"]


# the tiny model, 6 tokens, 20 held-out problems: what the eval, sample and rm tests run with (conftest's `eval_run`)
EVAL_TINY = ["model=tiny", "sampler.max_new_tokens=6", "data.heldout_size=20"]


def eval_cfg(*overrides: str):
    return compose("eval", [*EVAL_TINY, *overrides])


def eval_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]


def tiny_cfg(*overrides: str):
    return compose("train", [*TINY, *overrides])


def tiny_run(run_dir: Path, *overrides: str) -> recipe.Run:
    """The recipe's Run of a composed train config (no TINY defaults added), for calling `recipe.step` directly."""
    cfg = compose("train", list(overrides))
    chosen = choose(cfg.sampler)
    return recipe.setup(validate(recipe.with_section(cfg, "sampler", chosen.section), *train_command.CHECKS),
                        run_dir, SINGLE, chosen.why)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(record: dict) -> dict:
    """A metrics line without the wall-clock numbers."""
    wall_clock = ("tokens_per_s", "peak_memory_mb")
    return {k: v for k, v in record.items() if not k.startswith("time/") and k not in wall_clock}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (bytes), to prove an error changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, to prove a refusal changed nothing (.lock holds the last pid)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a finished run folder that a test may resume or damage (without the finished run's lock)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


# ---- labeled rows for reward-model training -------------------------------------------------------------------------

def letters(n: int) -> list[dict]:
    """Labeled rows any model can separate: completions ending in A are good, in B bad."""
    return [{"prompt": f"What is {i}?", "completion": f"{i} {'A' if i % 2 else 'B'}", "label": float(i % 2)}
            for i in range(n)]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path
