"""What the user sees and what the run leaves behind: a rich progress bar, metrics.jsonl, and the
experiment trackers of `trainer.report_to` (TensorBoard, W&B, trackio, MLflow), each offline or on
local files by default."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from grpo_cli import files
from grpo_cli.errors import ConfigError

console = Console(stderr=True)
if not console.is_terminal and "COLUMNS" not in os.environ:
    # piped to a file, rich would assume 80 columns and cut the progress bar's last columns ("eta 0:00:…");
    # lines are as long as their text instead (up to this width), as a log file wants them
    console.width = 200


@contextlib.contextmanager
def quiet(silent: bool = True) -> Iterator[None]:
    """Console output off (a rank other than 0 under torchrun) for the block, then as it was."""
    before = console.quiet
    console.quiet = silent or before
    try:
        yield
    finally:
        console.quiet = before


def progress(description: str) -> Progress:
    """A progress bar with ETA and a free-text field for the key numbers (`info`)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    console=console, transient=False)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    """Wait until the GPU has run the work queued so far, so that a timer read next counts it (CUDA kernels
    run asynchronously: without this a step's time is when its last kernel was queued). Nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak-memory count (CUDA); nothing on CPU (`peak_memory_mb` is the process's peak there)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def step_memory(device: torch.device) -> dict:
    """`memory/peak_allocated_gb` (tensors) and `memory/peak_reserved_gb` (held by PyTorch's caching allocator,
    what other processes cannot use) since `reset_peak_memory`, on CUDA; {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}




def mean(values) -> float:
    """Mean of the numbers that are present (None/NaN left out); NaN when none are."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else float("nan")


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep the lines of `path` whose "step" is <= last_step; returns how many unreadable lines were dropped.

    A line that does not parse (the partial last line of a killed run) is dropped, not fatal. The
    file is replaced atomically (written beside it, flushed, renamed), so a kill during the rewrite
    leaves the old file, never an empty one.
    """
    path = Path(path)
    if not path.exists():
        return 0
    keep, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            bad += line.strip() != ""
    files.write_text(path, "".join(line + "\n" for line in keep))
    if bad:
        console.print(f"[yellow]{path}: dropped {bad} unreadable line(s) (a run killed mid-write)")
    return bad


class MetricsLog:
    """One JSON object per step in RUN_DIR/metrics.jsonl, mirrored to the trackers of `report_to`.

    `report_to`: tracker names (`resolve_report_to` checks them); `project`: the wandb/trackio
    project or MLflow experiment. `config` (the resolved run config as plain containers) goes to
    each tracker as hyper-parameters once; every finite number of a step's record becomes a scalar
    at that step. Call `close()` at the end of the run: trackers flush and mark their run finished.
    """

    def __init__(self, run_dir: Path, report_to: list[str], project: str | None = None, config: dict | None = None,
                 *, writes: bool = True):
        # writes=False: a rank other than 0 under torchrun, whose numbers reach rank 0 through the reductions
        self.writes = writes
        self.path = Path(run_dir) / "metrics.jsonl"
        run_dir = Path(run_dir).resolve()
        self.trackers = [TRACKERS[name](run_dir, project, run_name(run_dir), config or {})
                         for name in resolve_report_to(report_to)] if writes else []
        if writes:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate(self, last_step: int) -> None:
        """On resume: drop lines of steps after the checkpoint, so the file reads as one run."""
        if self.writes:
            truncate_jsonl(self.path, last_step)

    def log(self, record: dict) -> None:
        if not self.writes:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(scalars, record["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


# ---- experiment trackers ----------------------------------------------------------------------
# Each one runs offline / on local files unless the tracker's own environment variable says
# otherwise (WANDB_MODE=online, TRACKIO_SPACE_ID, MLFLOW_TRACKING_URI), so a run never needs the
# network and never waits on it. A resumed run starts a new tracker run of the same name.

def run_name(run_dir: Path) -> str:
    """The tracker run name: the last two parts of the run folder (`DATE/TIME`, or `TIME/N` in a sweep)."""
    return "/".join(Path(run_dir).parts[-2:])


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"algo": {"beta": 0.04}} -> {"algo.beta": 0.04}; lists and None become strings (hparams take scalars)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


class _TensorBoard:
    """Event files in RUN/tensorboard: scalars per step, the config in the HPARAMS tab."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        for summary in hparams(flatten(config), {}):  # the experiment, session-start and -end summaries
            self.writer.file_writer.add_summary(summary)

    def log(self, scalars: dict, step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """An offline W&B run in RUN/wandb (`wandb sync RUN/wandb/offline-run-*` uploads it later)."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        import wandb

        # console="off": wandb would otherwise wrap stdout/stderr, under the rich progress bar
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              settings=wandb.Settings(console="off", quiet=True))

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    """A run in trackio's local store ($TRACKIO_DIR, default ~/.cache/huggingface/trackio): `trackio show`."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        import trackio

        self.run = trackio.init(project=project, name=name, config=config)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """An MLflow run in RUN/mlflow.db (SQLite; artifacts in RUN/mlflow-artifacts), unless
    $MLFLOW_TRACKING_URI names another store. `mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db`.

    Not MLflow's file store: MLflow >= 3.13 refuses it unless MLFLOW_ALLOW_FILE_STORE=true.
    """

    def __init__(self, run_dir: Path, project: str, name: str, config: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=(run_dir / "mlflow-artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]  # 6000: MLflow's value limit
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# `trainer.report_to` name -> tracker, and the package it needs (the pip extra has the tracker's name)
TRACKERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _MLflow}
PACKAGES = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "trackio": ["trackio"],
            "mlflow": ["mlflow", "sqlalchemy", "alembic"]}  # mlflow's SQLite store needs SQLAlchemy + alembic


def resolve_report_to(report_to) -> list[str]:
    """`trainer.report_to` as a list of tracker names: `auto` (tensorboard when installed, else none),
    one name, or a list. An unknown name or a tracker whose package is missing is a ConfigError
    naming the fix; call it before the model loads."""
    if report_to == "auto":
        return ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"trainer.report_to: {name!r} is not a tracker; use any of "
                              f"{', '.join(TRACKERS)} (or auto, or [] for none)")
        missing = [package for package in PACKAGES[name] if importlib.util.find_spec(package) is None]
        if missing:
            raise ConfigError(f"trainer.report_to includes {name} but the {missing[0]} package is not installed: "
                              f"pip install 'grpo-cli[{name}]', or leave {name} out of trainer.report_to")
    return list(dict.fromkeys(names))


# ---- completions log --------------------------------------------------------------------------

def check_logging(trainer) -> list[str]:
    """Check the `trainer` logging settings before the model loads; returns the trackers to open."""
    every, rows, max_mb = trainer.log_completions_every, trainer.num_completions_to_print, trainer.completions_max_mb
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ConfigError(f"trainer.log_completions_every ({every!r}) must be an integer >= 1 or null (never); "
                          f"set trainer.log_completions_every=10")
    if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0):
        raise ConfigError(f"trainer.num_completions_to_print ({rows!r}) must be an integer >= 0; "
                          f"set trainer.num_completions_to_print=4")
    if not (isinstance(max_mb, (int, float)) and not isinstance(max_mb, bool) and max_mb > 0):
        raise ConfigError(f"trainer.completions_max_mb ({max_mb!r}) must be > 0; set trainer.completions_max_mb=100")
    return resolve_report_to(trainer.report_to)


class CompletionsLog:
    """What the model wrote, every `every` steps (TRL's log_completions): a rich table of `rows`
    completions on the console, and every completion of the step appended to RUN/completions.jsonl.

    One JSON line per completion: step, prompt_id (the prompt's position in the seeded training
    stream: `PromptStream(data.train, seed)[prompt_id]` is the problem), question, completion,
    reward (combined), rewards (raw, per function, as in metrics' rewards/NAME/mean), advantage,
    truncated, length (tokens); process rewards add steps = [[char_end, step_reward], ...], and
    their advantage is the first token's (the sum of the completion's normalized step rewards).
    The file stops growing once it reaches `max_mb` (one line says so); the tables go on.
    """

    def __init__(self, run_dir: Path, every: int | None, rows: int, max_mb: float):
        self.path = Path(run_dir) / "completions.jsonl"
        self.every, self.rows, self.max_bytes = every, rows, int(max_mb * 2**20)
        self.full = False

    def truncate(self, last_step: int) -> None:
        """On resume: drop lines of steps after the checkpoint, so the file reads as one run."""
        truncate_jsonl(self.path, last_step)

    def log(self, step: int, prompt_ids: list[int], examples: list[dict], rollout, result, advantages,
            world=None) -> None:
        """Log step `step` if it is one of every `every`; examples[i] (stream position prompt_ids[i]) owns rows
        i*G .. i*G+G-1.

        With N ranks (`world`), every rank calls this with its own slice and rank 0 writes them all, in
        rank order, each line with its `rank`.
        """
        if not self.every or step % self.every:
            return
        lines = self.records(step, prompt_ids, examples, rollout, result, advantages)
        if world is not None and world.size > 1:
            lines = [{**line, "rank": rank} for rank, part in enumerate(world.gather(lines)) for line in part]
            if not world.main:
                return
        if self.rows:
            console.print(self.table(step, lines))
        self.append(lines)

    @staticmethod
    def records(step: int, prompt_ids: list[int], examples: list[dict], rollout, result, advantages) -> list[dict]:
        G = len(rollout.texts) // len(examples)
        adv = advantages.reshape(len(rollout.texts), -1)[:, 0].tolist()  # [N]; process: the first token's
        lengths = rollout.lengths
        out = []
        for row, text in enumerate(rollout.texts):
            line = {"step": step, "prompt_id": prompt_ids[row // G], "question": examples[row // G].get("question"),
                    "completion": text, "reward": result.rewards[row],
                    "rewards": {name: values[row] for name, values in result.per_function.items()},
                    "advantage": adv[row], "truncated": bool(rollout.truncated[row]), "length": int(lengths[row])}
            if result.steps is not None:
                line["steps"] = [[int(end), float(r)] for end, r in result.steps[row]]
            out.append(line)
        return out

    def table(self, step: int, lines: list[dict]) -> Table:
        """`rows` completions spread over the step's prompts: question, completion, rewards, advantage."""
        picks = lines[:: max(1, len(lines) // self.rows)][: self.rows]
        table = Table(title=f"step {step}: {len(picks)} of {len(lines)} completions (all in {self.path.name})",
                      show_lines=True)
        names = list(lines[0]["rewards"]) if lines else []
        table.add_column("prompt", ratio=2, overflow="fold")
        table.add_column("completion", ratio=4, overflow="fold")
        for name in names:
            table.add_column(name, justify="right")
        table.add_column("reward", justify="right")
        table.add_column("advantage", justify="right")
        for line in picks:
            prompt = Text(f"#{line['prompt_id']} {line['question']}")  # Text: no rich markup in user data
            table.add_row(prompt, step_text(line["completion"], line.get("steps")),
                          *[_number(line["rewards"][name]) for name in names], _number(line["reward"]),
                          f"{line['advantage']:+.3f}")
        return table

    def append(self, lines: list[dict]) -> None:
        if self.full or (self.path.exists() and self.path.stat().st_size >= self.max_bytes):
            if not self.full:
                console.print(f"[yellow]{self.path} reached trainer.completions_max_mb "
                              f"({self.max_bytes / 2**20:g} MB): no more completions are written to it")
            self.full = True
            return
        with self.path.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


def step_text(completion: str, steps: list | None) -> Text:
    """The completion; with process rewards each step is coloured by the sign of its reward, `[+r]` after it."""
    text = Text()
    start = 0
    for end, reward in steps or []:
        style = "green" if reward > 0 else "red" if reward < 0 else "dim"
        text.append(completion[start:end], style=style)
        text.append(f" [{reward:+.2f}] ", style=f"bold {style}")
        start = end
    text.append(completion[start:])
    return text


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def rollout_metrics(result, rollout, group_size: int) -> dict:
    """Reward and completion statistics, named as TRL names them."""
    # [B, G]; NaN = no score
    rewards = torch.tensor([math.nan if r is None else float(r) for r in result.rewards]).view(-1, group_size)
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


def plot_training(run_dir: Path, keys: tuple[str, ...] = ("reward", "kl", "completions/mean_length")) -> Path | None:
    """RUN_DIR/training.png: each of `keys` against the step, from metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        ax.plot([r["step"] for r in records], [r.get(key, float("nan")) for r in records], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
