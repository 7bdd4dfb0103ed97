"""User reward functions in a training run, as TRL runs them: a math_verify reward scores, and a call that hangs
costs that call only (grpo_cli/rewards/guard.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.runs import metrics
from tests.helpers.tools import TRL_ACCURACY

# a reward whose first call never returns (an endless loop, holding the CPU); its later calls score 0.5
HANGS_ONCE = '''
import pathlib

def hangs_once(prompts, completions, **kwargs):
    first = pathlib.Path("first_call")
    if not first.exists():
        first.touch()
        while True:
            pass
    return [0.5] * len(completions)
'''

TIMEOUT_S = 4

# the tiny model, 2 prompts x G=2 for 2 steps, 8 new tokens
TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=2", "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4", "trainer.warmup_steps=0", "trainer.report_to=[]", "trainer.max_steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[dict]:
    """The metrics of a 2-step run scored by both functions, from a folder that holds them and the data."""
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / "trl_rewards.py").write_text(TRL_ACCURACY)
    (folder / "slow.py").write_text(HANGS_ONCE)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": f"${2 * i}$"}
            for i in range(12)]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_cli(["train", *TINY, "data=hf", "data.path=data.jsonl", "data.heldout_size=2", "reward=custom",
                   "reward.funcs=[trl_rewards.accuracy_reward,slow.hangs_once]", f"reward.timeout_s={TIMEOUT_S}",
                   "hydra.run.dir=run"], cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    return metrics(Path(folder) / "run")


def test_trls_math_verify_accuracy_reward_scores_every_step(run):
    # a score (0.0 or 1.0) for every completion, not None: math_verify's defaults ran where they work
    assert [m["step"] for m in run if math.isfinite(m["rewards/accuracy_reward/mean"])] == [1, 2]


def test_a_hung_call_costs_that_call_only(run):
    first, second = run
    # step 1's call passed the timeout and lost its scores; step 2's call ran and scored
    assert math.isnan(first["rewards/hangs_once/mean"]) and first["time/step_s"] >= TIMEOUT_S
    assert second["rewards/hangs_once/mean"] == 0.5
    # and nothing left running from step 1 slows step 2 (an abandoned thread looping on would)
    assert second["time/step_s"] < TIMEOUT_S


@pytest.mark.slow
@pytest.mark.ci
def test_trls_math_verify_reward_scores_a_right_answer_1_in_a_run(tmp_path):
    """The embedded SmolLM2, near-greedy, on a question it answers right: TRL's accuracy reward gives those
    completions 1.0 in a run (the tiny model above never answers right, so it shows scores, not 1.0)."""
    (tmp_path / "trl_rewards.py").write_text(TRL_ACCURACY)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}? Reply with the number only."}],
             "solution": f"${2 * a}$"} for a in (1, 2, 3, 4, 5)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_cli(["train", "sampler=default", "sampler.max_new_tokens=8", "sampler.temperature=0.01",
                   "algo.group_size=2", "trainer.prompts_per_step=1", "trainer.max_steps=1", "trainer.report_to=[]",
                   "trainer.log_completions_every=1", "trainer.eval_every=null", "data=hf", "data.path=data.jsonl",
                   "data.heldout_size=1",
                   "reward=custom", "reward.funcs=[trl_rewards.accuracy_reward]", "hydra.run.dir=run"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    completions = [json.loads(line) for line in (tmp_path / "run/completions.jsonl").read_text().splitlines()]
    # right by our own reading (the last word is the sum), and 1.0 by TRL's reward
    right = [c for c in completions if c["completion"].split()[-1] == str(2 * int(c["question"].split()[2]))]
    assert len(right) == len(completions) == 2, completions
    assert all(c["rewards"]["accuracy_reward"] == 1.0 for c in right)
    assert [m["rewards/accuracy_reward/mean"] for m in metrics(tmp_path / "run")] == [1.0]
