"""User reward functions as TRL's GRPOTrainer runs them (grpo_cli/rewards/user.py), built from conf/reward/custom.yaml:
math_verify with its defaults, functions that mutate their inputs, TRL's own keyword arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards.call import check_columns
from tests.helpers.tools import TRL_ACCURACY

# one function changes what it was given (the completions, a column, a message of the prompt); the next scores 1.0
# only when it sees the inputs as they were
MUTATING = '''
def mutate(prompts, completions, answer, **kwargs):
    completions[0] = [{"role": "assistant", "content": "changed"}]
    answer[0] = "changed"
    prompts[0][0]["content"] = "changed"
    kwargs["completion_length"].append(99)
    return [0.0] * len(answer)

def untouched(prompts, completions, answer, completion_length, **kwargs):
    seen = (completions[0][0]["content"], answer[0], prompts[0][0]["content"], len(completion_length))
    return [float(seen == ("7", "7", "q", 1))] * len(answer)
'''

PROMPT = [[{"role": "user", "content": "q"}]]


def custom(tmp_path: Path, *funcs: str, **overrides):
    """reward=custom as conf/reward/custom.yaml builds it, the functions from `tmp_path`/rewards.py."""
    section = OmegaConf.merge(OmegaConf.load(CONF_DIR / "reward" / "custom.yaml"),
                              {"funcs": [f"{tmp_path}/rewards.py:{f}" for f in funcs], **overrides})
    return build(section)


def test_trls_accuracy_reward_with_math_verify_defaults_scores_a_right_answer_1(tmp_path):
    (tmp_path / "rewards.py").write_text(TRL_ACCURACY)
    reward = custom(tmp_path, "accuracy_reward")
    result = reward(PROMPT * 2, ["So the answer is $\\boxed{4}$.", "It is $5$."],
                    {"prompt": PROMPT * 2, "solution": ["$4$", "$4$"]})
    assert result.per_function["accuracy_reward"] == [1.0, 0.0] and result.failures == 0


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_a_function_that_mutates_its_inputs_does_not_change_the_next_ones(tmp_path, worker):
    (tmp_path / "rewards.py").write_text(MUTATING)
    reward = custom(tmp_path, "mutate", "untouched", worker=worker)
    prompt = [[{"role": "user", "content": "q"}]]
    columns = {"prompt": prompt, "answer": ["7"], "completion_length": [3]}
    result = reward(prompt, ["7"], columns)
    assert result.per_function["untouched"] == [1.0]
    assert columns == {"prompt": [[{"role": "user", "content": "q"}]], "answer": ["7"], "completion_length": [3]}


def test_a_function_that_takes_trainer_state_is_told_it_is_not_passed(tmp_path):
    (tmp_path / "rewards.py").write_text("def scheduled(prompts, completions, trainer_state, **kwargs):\n"
                                         "    return [trainer_state.global_step / 100] * len(completions)\n")
    with pytest.raises(ConfigError) as err:
        check_columns(custom(tmp_path, "scheduled"), {"question": "q", "prompt": "q", "answer": "1"})
    line = str(err.value)
    assert "takes trainer_state, TRL's TrainerState (global_step, max_steps, ...), which grpo does not" in line
    assert "trainer_state=None" in line and "add that column" not in line and "\n" not in line


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_a_column_that_cannot_reach_a_worker_process_is_refused_before_the_model_loads(tmp_path, worker):
    (tmp_path / "rewards.py").write_text("def any_score(prompts, completions, **kwargs):\n"
                                         "    return [1.0] * len(completions)\n")
    reward = custom(tmp_path, "any_score", worker=worker)
    with open(tmp_path / "rewards.py") as log:  # an open file does not pickle
        example = {"question": "q", "prompt": "q", "environments": log}
        if worker == "thread":  # the function runs in this process and is handed the object itself
            check_columns(reward, example)
            return
        with pytest.raises(ConfigError) as err:
            check_columns(reward, example)
    line = str(err.value)
    assert line.startswith("reward function 'any_score' runs in a worker process (reward.worker=process) and is "
                           "given column 'environments' (a TextIOWrapper), which cannot be sent to it ("), line
    assert line.endswith("; set reward.worker=thread to run the reward functions in this process") and "\n" not in line
