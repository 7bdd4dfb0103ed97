"""`grpo train env=class` with a TRL-style environment class, unchanged: an async tool, `get_reward` as the run's
reward source (not a tool), pooled instances reset between episodes and closed at the end, the dataset row reaching
`reset`; and an environment that writes its own prompts (data=env, no dataset file). The tiny random model never
writes a call by itself: the first turn of every episode is a scripted multiply(4, 3) call
(tests.helpers.tools.first_turn_calls); every later turn is the model's own."""

from __future__ import annotations

import gc
import json

from tests.helpers.cli import run_cli
from tests.helpers.runs import EVAL_TINY, TINY, metrics
from tests.helpers.tools import first_turn_calls

MY_ENV = '''
import asyncio
import os
import uuid


class Multiplier:
    """Scores itself: 1 when the episode's call returned 12."""

    def __init__(self):
        # its name in the files below: id() is reused once an instance is collected, a uuid never
        self.name = uuid.uuid4().hex

    def reset(self, **row):
        assert "messages" not in row and "question" not in row and "answer" in row  # the row, as the data gives it
        self.product = None
        with open("resets.txt", "a") as f:
            f.write(f"{os.getpid()} {self.name}\\n")

    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        await asyncio.sleep(0)
        self.product = a * b
        return self.product

    def get_reward(self) -> float:
        return 1.0 if self.product == 12 else 0.0

    def close(self) -> None:
        with open("closed.txt", "a") as f:
            f.write(f"{self.name}\\n")


def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)
'''


def test_a_trl_style_environment_trains_unchanged(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(MY_ENV)
    first_turn_calls(monkeypatch)
    out = tmp_path / "run"
    # the collector off: the instances close because the run ends, not because the collector happened to find the
    # environment unreachable before the checks below (a full-suite run once found 1 of 17 closed)
    gc.disable()
    try:
        code, _, err = run_cli(["train", *TINY[:-2], "trainer.max_steps=2", f"hydra.run.dir={out}", "env=class",
                                "env.factory=my_env.Multiplier", "env.max_episode_tokens=100", "env.max_turns=2",
                                "reward=custom", "reward.funcs=[my_env.zero]"], cwd=tmp_path)
    finally:
        gc.enable()
    assert code == 0, err
    records = metrics(out)
    # the environment's own score is the reward: its functions give 0, get_reward 1 for every episode
    assert [r["reward"] for r in records] == [1.0, 1.0]
    assert all(r["rewards/Multiplier/mean"] == 1.0 for r in records)
    assert all(r["tools/call_frequency"] == 1.0 and r["tools/failure_frequency"] == 0.0 for r in records)
    resets = (tmp_path / "resets.txt").read_text().split()[1::2]
    instances = set(resets)
    # 2 steps x 2 prompts x G=4 episodes (and the check's reset): reset per episode, far fewer instances built
    assert len(resets) == 1 + 2 * 2 * 4 and len(instances) <= 2 * 2 * 4
    # every instance closed once at the end, those of the episodes and the ones only built for the checks
    closed = (tmp_path / "closed.txt").read_text().split()
    assert len(closed) == len(set(closed)) and instances <= set(closed)


# an environment that owns its data (data=env): no dataset file, no prompt column; reset(seed) writes the prompt
OWN_PROMPTS = '''
class Multiplier:
    def reset(self, seed, **row):
        assert row == {}  # the row is its seed alone: no prompt, nor grpo's messages
        self.seed, self.product = seed, None
        with open("seeds.txt", "a") as f:
            f.write(f"{seed}\\n")
        return f"Game {seed}: multiply 4 by 3."

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.product = a * b
        return self.product

    def get_reward(self) -> float:
        return 1.0 if self.product == 12 else 0.0


def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)
'''


def test_an_environment_that_writes_its_prompts_trains_without_a_dataset(tmp_path, monkeypatch):
    from grpo_cli.rollout.hf import HFEngine

    (tmp_path / "my_env.py").write_text(OWN_PROMPTS)
    first_turn_calls(monkeypatch)
    seen = []  # every sequence the engine continued, decoded
    engine_turn = HFEngine.continue_batch
    monkeypatch.setattr(HFEngine, "continue_batch", lambda self, sequences, max_new: seen.extend(
        self.tokenizer.decode(s) for s in sequences) or engine_turn(self, sequences, max_new))
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *TINY[:-2], "trainer.max_steps=2", f"hydra.run.dir={out}", "data=env",
                            "data.size=50", "data.heldout_size=4", "trainer.eval_every=2", "trainer.eval_size=2",
                            "env=class", "env.factory=my_env.Multiplier", "env.max_episode_tokens=100",
                            "env.max_turns=2", "reward=custom", "reward.funcs=[my_env.zero]"], cwd=tmp_path)
    assert code == 0, err
    assert [r["reward"] for r in metrics(out)] == [1.0, 1.0]  # get_reward, every episode
    seeds = [int(s) for s in (tmp_path / "seeds.txt").read_text().split()]
    # the check's reset on row 0, 2 steps x 2 prompts x G=4 episodes on training seeds (0..49), then the in-run
    # eval's greedy episodes on the first two held-out seeds (50, 51)
    assert seeds[0] == 0 and all(s < 50 for s in seeds[1:17]) and seeds[17:] == [50, 51]
    # each episode's prompt is what its reset returned, the whole user turn
    assert all(any(f"<|im_start|>user\nGame {s}: multiply 4 by 3.<|im_end|>" in text for text in seen)
               for s in seeds[1:])
    rows = [json.loads(line) for line in (out / "evals" / "step_000002.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == ['{"seed": 50}', '{"seed": 51}']
    assert [r["greedy"]["reward"] for r in rows] == [1.0, 1.0]


ENV_ARGS = ["env=class", "env.factory=my_env.Multiplier", "env.max_episode_tokens=100", "env.max_turns=2",
            "reward=custom", "reward.funcs=[my_env.zero]"]


def test_eval_and_sample_close_the_environment_when_they_end(tmp_path, monkeypatch):
    """As a training run: the instances are closed when the command ends, not when the collector finds them (a
    process that goes on, a notebook or a sweep, would see them open)."""
    (tmp_path / "my_env.py").write_text(MY_ENV)
    first_turn_calls(monkeypatch)
    for command in (["eval", *EVAL_TINY, "eval.limit=2"], ["sample", "model=tiny", "sampler.max_new_tokens=6",
                                                         "sample.num_prompts=2", "sample.n=2"]):
        for name in ("resets.txt", "closed.txt"):
            (tmp_path / name).unlink(missing_ok=True)
        gc.disable()
        try:
            code, _, err = run_cli([*command, *ENV_ARGS, f"hydra.run.dir={tmp_path / command[0]}"], cwd=tmp_path)
        finally:
            gc.enable()
        assert code == 0, err
        instances = set((tmp_path / "resets.txt").read_text().split()[1::2])
        closed = (tmp_path / "closed.txt").read_text().split() if (tmp_path / "closed.txt").exists() else []
        assert instances and instances <= set(closed), command[0]
