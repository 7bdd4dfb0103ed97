"""`grpo train env=class` with a TRL-style environment class, unchanged: an async tool, `get_reward` as the run's
reward source (not a tool), pooled instances reset between episodes and closed at the end, the dataset row reaching
`reset`. The tiny random model never writes a call by itself: the first turn of every episode is a scripted
multiply(4, 3) call (tests.helpers.first_turn_calls); every later turn is the model's own."""

from __future__ import annotations

from tests.helpers import TINY, first_turn_calls, metrics, run_cli

MY_ENV = '''
import asyncio
import os


class Multiplier:
    """Scores itself: 1 when the episode's call returned 12."""

    def reset(self, **row):
        assert "messages" not in row and "question" not in row and "answer" in row  # the row, as the data gives it
        self.product = None
        with open("resets.txt", "a") as f:
            f.write(f"{os.getpid()} {id(self)}\\n")

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
            f.write(f"{id(self)}\\n")


def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)
'''


def test_a_trl_style_environment_trains_unchanged(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(MY_ENV)
    first_turn_calls(monkeypatch)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *TINY[:-2], "trainer.max_steps=2", f"hydra.run.dir={out}", "env=class",
                            "env.factory=my_env.Multiplier", "env.max_episode_tokens=100", "env.max_turns=2",
                            "reward=custom", "reward.funcs=[my_env.zero]"], cwd=tmp_path)
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
