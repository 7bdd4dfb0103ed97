"""What a run leaves in its folder as it goes: RUN/metrics.jsonl (one line per step, mirrored to the
trackers), RUN/completions.jsonl (what the model wrote, every `trainer.log_completions_every` steps, with a
table on the console), both cut back to the checkpoint on resume; and the check of those `trainer` settings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.table import Table
from rich.text import Text

from grpo_cli import files
from grpo_cli.checks import is_num
from grpo_cli.errors import ConfigError
from grpo_cli.metrics.console import console
from grpo_cli.metrics.trackers import TRACKERS, resolve_report_to, run_name


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


def check_logging(trainer) -> list[str]:
    """Check the `trainer` logging settings before the model loads; returns the trackers to open."""
    every, rows, max_mb = trainer.log_completions_every, trainer.num_completions_to_print, trainer.completions_max_mb
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ConfigError(f"trainer.log_completions_every ({every!r}) must be an integer >= 1 or null (never); "
                          f"set trainer.log_completions_every=10")
    if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0):
        raise ConfigError(f"trainer.num_completions_to_print ({rows!r}) must be an integer >= 0; "
                          f"set trainer.num_completions_to_print=4")
    if not (is_num(max_mb) and max_mb > 0):
        raise ConfigError(f"trainer.completions_max_mb ({max_mb!r}) must be > 0; set trainer.completions_max_mb=100")
    return resolve_report_to(trainer.report_to)


class CompletionsLog:
    """What the model wrote, every `every` steps (TRL's log_completions): a rich table of `rows`
    completions on the console, and every completion of the step appended to RUN/completions.jsonl.

    One JSON line per completion: step, prompt_id (the prompt's position in the seeded training
    stream: `PromptStream(data.train, seed)[prompt_id]` is the problem), question, completion,
    reward (combined), rewards (raw, per function, as in metrics' rewards/NAME/mean), advantage,
    truncated, length (tokens); process rewards add steps = [[char_end, step_reward], ...], and
    their advantage is the first token's (the sum of the completion's normalized step rewards); per-turn rewards
    add turn_rewards, one per assistant turn.
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
            if getattr(result, "turns", None) is not None:  # per-turn rewards, one per assistant turn (None: unscored)
                line["turn_rewards"] = result.turns[row]
            if getattr(rollout, "episodes", None):  # multi-turn: the assistant turns, calls and tool results
                episode = rollout.episodes[row]
                line.update(turns=episode.messages, tool_calls=episode.tool_calls,
                            tool_failures=episode.tool_failures, stop=episode.stop)
            out.append(line)
        return out

    def table(self, step: int, lines: list[dict]) -> Table:
        """`rows` completions spread over the step's prompts: question, completion (an episode's turns one by one),
        rewards, advantage."""
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
            shown = (turns_text(line["turns"], line.get("turn_rewards")) if "turns" in line
                     else step_text(line["completion"], line.get("steps")))
            table.add_row(prompt, shown,
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


def turns_text(turns: list[dict], rewards: list | None = None) -> Text:
    """An episode's turns, readable: each assistant turn's text as written (its tool calls in it), with its
    per-turn reward `[+r]` after it when the turns are scored one by one, and each tool's result on a line of its
    own, `[name] -> result`; train's table and `grpo sample` show episodes this way."""
    text = Text()
    rewards = list(rewards or [])
    for k, message in enumerate(turns):
        if k:
            text.append("\n")
        if message["role"] == "tool":
            text.append(f"[{message['name']}] -> {message['content']}", style="cyan")
            continue
        text.append(message["content"])
        reward = rewards.pop(0) if rewards else None
        if reward is not None:
            style = "green" if reward > 0 else "red" if reward < 0 else "dim"
            text.append(f" [{reward:+.2f}]", style=f"bold {style}")
    return text


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"
