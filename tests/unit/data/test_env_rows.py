"""`data=env` (grpo_cli.data.EnvTask): rows without prompts, for an environment class that writes each prompt in
`reset` (TRL's environment-owned data): generated seeds or a file's rows, each example an empty user turn that
the environment fills, its row's columns for `reset(**row)`."""

from __future__ import annotations

import pytest

from grpo_cli.config import compose, validate
from grpo_cli.data import EnvTask, load_task
from grpo_cli.errors import ConfigError, DataError
from tests.helpers.runs import write_jsonl


def test_generated_rows_are_seeds_the_held_out_ones_past_the_training_ones():
    task = load_task("env", size=30, heldout_size=5)
    assert isinstance(task, EnvTask) and (len(task.train), len(task.heldout)) == (30, 5)
    # row i of train is seed i; the held-out seeds follow: 30 .. 34, none a training seed
    assert [e["seed"] for e in task.train] == list(range(30))
    assert [e["seed"] for e in task.heldout] == [30, 31, 32, 33, 34]
    example = task.train[7]
    # the prompt is the environment's: an empty user turn it fills, and no prompt as the data gives it
    assert example["messages"] == [{"role": "user", "content": ""}] and example["prompt"] is None
    assert example["question"] == '{"seed": 7}'  # what logs and reward functions see in its place
    assert "answer" not in example


def test_auto_holds_out_a_tenth_of_the_generated_rows():
    # size 1000 -> 100 held out (a tenth, at most 200), as the other tasks' auto
    task = load_task("env", size=1000)
    assert len(task.heldout) == 100 and task.heldout[0]["seed"] == 1000


def test_a_system_prompt_comes_before_the_environments_turn():
    task = load_task("env", size=3, heldout_size=1, system_prompt="Play.")
    assert task.train[0]["messages"] == [{"role": "system", "content": "Play."}, {"role": "user", "content": ""}]


def test_a_files_rows_are_the_rows_and_test_jsonl_is_held_out(tmp_path):
    folder = tmp_path / "games"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"secret": s} for s in range(1, 16)])
    write_jsonl(folder / "test.jsonl", [{"secret": s} for s in range(1, 16)])
    task = load_task("env", path=str(folder))
    # rows are not compared: a held-out row may equal a training row (the prompt is the environment's)
    assert [e["secret"] for e in task.train] == list(range(1, 16))
    assert [e["secret"] for e in task.heldout] == list(range(1, 16))
    assert task.heldout[0] == {"messages": [{"role": "user", "content": ""}], "question": '{"secret": 1}',
                               "prompt": None, "secret": 1}


def test_a_single_file_gives_a_seeded_held_out_slice(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"level": i} for i in range(20)])
    task = load_task("env", path=str(path), heldout_size=4, seed=3)
    held = [e["level"] for e in task.heldout]
    assert len(held) == 4 and sorted(held + [e["level"] for e in task.train]) == list(range(20))
    assert held == [e["level"] for e in load_task("env", path=str(path), heldout_size=4, seed=3).heldout]
    assert held != [e["level"] for e in load_task("env", path=str(path), heldout_size=4, seed=4).heldout]


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "Guess.", "secret": 3}, {"prompt": "Guess.", "secret": 4}],
     "column 'prompt' has a name grpo uses for the prompt or the reward call"),
    ([], "holds no rows"),
])
def test_bad_rows_are_one_line_naming_the_fix(tmp_path, rows, says):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_task("env", path=str(path), heldout_size=1)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_too_many_held_out_rows_leave_none_to_train_on(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"level": i} for i in range(3)])
    with pytest.raises(DataError, match=r"no training rows left after holding out 3 .*set data.heldout_size=2"):
        load_task("env", path=str(path), heldout_size=3)


def test_size_must_be_a_positive_integer():
    with pytest.raises(ConfigError, match=r"data.size \(0\) must be an integer >= 1; set data.size=1000"):
        load_task("env", size=0)


@pytest.mark.parametrize("env", [[], ["env=tools", "env.tools=[x.y]"]], ids=["no-env", "tools"])
def test_data_env_without_an_environment_class_is_one_line_before_the_model(env):
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["model=tiny", "data=env", *env]))
    lines = [line for line in str(err.value).splitlines() if line.startswith("data=env")]
    assert lines == ["data=env has no prompts: an environment class writes each one (its reset returns it); set "
                     "env=class env.factory=my_env.Game"]
