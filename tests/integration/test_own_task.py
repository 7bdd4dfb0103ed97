"""Issue #22, bring your own task: `data=hf` (TRL's two prompt formats, any `datasets` source) and
`reward=custom` (the user's own TRL-style reward functions), end to end and each bad input as one line.

The end-to-end tests run the CLI as a user does, in a subprocess whose working directory holds the
data and a reward file written by the test (not in the package): 2 training steps of the tiny
model, then `grpo eval` and `grpo sample` of that run. The reward file appends what each call
received to calls.jsonl, and the tests check that every column reached it, aligned with the
completions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli.data import build_task, load_task
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.instantiate import build
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards import OutcomeReward
from grpo_cli.rewards.call import check_columns, score
from grpo_cli.rewards.user import CustomReward
from grpo_cli.rollout import Rollout
from tests.helpers.cli import run_cli

# the tiny model, two steps of 2 prompts x G=2, 8 new tokens; no in-run eval, so a reward function's calls are the
# steps' (tests/integration/test_heldout_eval.py scores the in-run eval with the run's reward)
TINY = ["model=tiny", "sampler.max_new_tokens=8", "algo.group_size=2", "trainer.prompts_per_step=2",
        "trainer.micro_batch_size=4", "trainer.warmup_steps=0", "trainer.report_to=[]", "trainer.max_steps=2",
        "trainer.eval_every=null"]

# the "format reward" of TRL's GRPOTrainer documentation, quoted unchanged ("Using a custom reward function",
# Example 2: https://huggingface.co/docs/trl/grpo_trainer#example-2-reward-completions-with-a-specific-format);
# it reads completion[0]["content"], so it runs only on conversational completions as TRL passes them
TRL_FORMAT_REWARD = '''
import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
'''

# a user's reward file: records each call in calls.jsonl (the working directory) and pays for odd lengths
MY_REWARDS = TRL_FORMAT_REWARD + '''
import json

def record(prompts, completions, word, **kwargs):
    with open("calls.jsonl", "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "word": word, "kwargs": kwargs}) + "\\n")
    text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t) % 2) for t in text]

def no_kwargs(prompts, completions):
    return [0.0 for _ in completions]
'''


def grpo(*args: str, cwd: Path):
    """`grpo ARGS` from `cwd`, in this process."""
    return run_cli(args, cwd=cwd)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def standard_rows(n: int = 12) -> list[dict]:
    return [{"prompt": f"Say the word w{i}.", "word": f"w{i}", "answer": str(i)} for i in range(n)]


def conversational_rows(n: int = 12) -> list[dict]:
    return [{"prompt": [{"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": f"Say the word w{i}."}], "word": f"w{i}"} for i in range(n)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    """A user's folder: the reward file, a standard JSONL and a conversational parquet (no answers)."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    write_jsonl(tmp_path / "standard.jsonl", standard_rows())
    write_parquet(tmp_path / "chat.parquet", conversational_rows())
    return tmp_path


def calls(folder: Path) -> list[dict]:
    path = folder / "calls.jsonl"
    out = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return out


def check_calls(records: list[dict], conversational: bool) -> None:
    """Each call got the columns aligned with its completions, the rollout's columns, and the prompt only as
    `prompts`, in the format TRL would use."""
    assert records
    for call in records:
        n = len(call["completions"])
        assert n and len(call["prompts"]) == len(call["word"]) == n
        kwargs = call["kwargs"]
        assert "prompt" not in kwargs and "messages" not in kwargs and "question" not in kwargs
        assert kwargs["completion_length"] == [len(ids) for ids in kwargs["completion_ids"]]
        assert len(kwargs["truncated"]) == n
        for prompt, word, completion in zip(call["prompts"], call["word"], call["completions"]):
            if conversational:
                assert prompt[0] == {"role": "system", "content": "Answer in one word."}
                assert prompt[-1]["content"] == f"Say the word {word}."
                assert isinstance(completion, list) and len(completion) == 1
                assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
            else:
                assert prompt == f"Say the word {word}."  # the column value belongs to this completion's prompt
                assert isinstance(completion, str)
        if not conversational:
            assert [a for a in kwargs["answer"]] == [re.sub(r"\D", "", w) for w in call["word"]]


# ---- end to end: train, eval, sample ----------------------------------------------------------

def test_standard_jsonl_columns_reach_a_user_reward_in_train_eval_and_sample(workdir):
    out = grpo("train", *TINY, "data=hf", "data.path=standard.jsonl", "data.heldout_size=2", "reward=custom",
               "reward.funcs=[my_rewards.record,accuracy]", "reward.weights=[1.0,0.5]", "hydra.run.dir=run",
               cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(train_calls := calls(workdir), conversational=False)
    assert len(train_calls) == 2  # one call per step
    records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("rewards/record/mean" in r and "rewards/accuracy/mean" in r for r in records)

    out = grpo("eval", "checkpoint=run", "eval.limit=2", "hydra.run.dir=ev", cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(calls(workdir), conversational=False)
    result = json.loads((workdir / "ev" / "eval.json").read_text())["results"][0]
    assert result["num_problems"] == 2 and result["accuracy"] is not None and result["mean_reward"] is not None

    out = grpo("sample", "checkpoint=run", "sample.num_prompts=2", "sample.n=2", "sample.output=samples.jsonl",
               "hydra.run.dir=sm", cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(calls(workdir), conversational=False)
    samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["reward"] is not None for s in samples)


def test_the_docs_two_row_example_trains_as_written(tmp_path):
    # docs/your-own-task.md's two rows and its unit_reward, and its command with nothing added but the tiny model
    write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "How far is it from Paris to Lyon?", "unit": "km", "answer": "465"},
        {"prompt": "How much does a litre of water weigh?", "unit": "kg", "answer": "1"}])
    (tmp_path / "my_rewards.py").write_text("def unit_reward(prompts, completions, unit, **kwargs):\n"
                                            "    return [float(u in c) for c, u in zip(completions, unit)]\n")
    out = grpo("train", *TINY, "data=hf", "data.path=prompts.jsonl", "reward=custom",
               "reward.funcs=[my_rewards.unit_reward,accuracy]", "hydra.run.dir=run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # one row held out (a tenth of 2, at least 1), said in one line; the other trains
    # the path as the run saves it: made absolute against the folder the run started in (resume from anywhere)
    assert f"data: 1 of {tmp_path / 'prompts.jsonl'}'s 2 rows held out for eval (data.heldout_size=auto" in out.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # 3 CLI runs (~21 s); the standard-format run above covers the same path in the fast suite
def test_conversational_parquet_without_answers_trains_evals_and_samples_with_trl_rewards(workdir):
    # TRL's documented format reward runs unchanged beside a recording one; the data has no answer column
    out = grpo("train", *TINY, "data=hf", "data.path=chat.parquet", "data.heldout_size=2", "reward=custom",
               "reward.funcs=[my_rewards.record,my_rewards.py:format_reward_func]", "hydra.run.dir=run", cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(calls(workdir), conversational=True)
    records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    # the format reward scored every completion (0.0: a random model writes no <think> tags), nothing failed
    assert all(r["rewards/format_reward_func/mean"] == 0.0 and r["reward_failures"] == 0 for r in records)

    out = grpo("eval", "checkpoint=run", "eval.limit=2", "eval.num_samples=2", "eval.k=[1,2]", "hydra.run.dir=ev",
               cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(calls(workdir), conversational=True)
    result = json.loads((workdir / "ev" / "eval.json").read_text())["results"][0]
    # no reference answers: no accuracy, pass@k or maj@k; the mean reward is the number
    assert result["accuracy"] is None and "pass@k" not in result and result["mean_reward"] is not None

    out = grpo("sample", "checkpoint=run", "sample.num_prompts=1", "sample.n=2", "hydra.run.dir=sm", cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    check_calls(calls(workdir), conversational=True)


# ---- the data: formats and sources -------------------------------------------------------------

def test_a_save_to_disk_folder_and_its_test_split(tmp_path):
    import datasets

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(standard_rows(10)),
                                   "test": datasets.Dataset.from_list(standard_rows(13)[10:])})
    splits.save_to_disk(str(tmp_path / "dict"))
    task = load_task("hf", path=str(tmp_path / "dict"))
    assert [e["word"] for e in task.heldout] == ["w10", "w11", "w12"]  # the test split is the held-out set
    assert len(task.train) == 10 and not task.conversational

    datasets.Dataset.from_list(conversational_rows(10)).save_to_disk(str(tmp_path / "one"))
    task = load_task("hf", path=str(tmp_path / "one"), heldout_size=3, system_prompt="ignored: messages stay")
    assert task.conversational and len(task.train) == 7 and len(task.heldout) == 3
    example = task.train[0]
    assert example["messages"] == example["prompt"] and example["messages"][0]["role"] == "system"
    assert example["question"] == example["messages"][-1]["content"] and set(example) == {
        "messages", "question", "prompt", "word"}


def test_a_folder_of_files_and_a_seeded_heldout_slice(tmp_path):
    rows = standard_rows(20) + [standard_rows(20)[3]]  # a repeated prompt
    write_jsonl(tmp_path / "train.jsonl", rows)
    first = load_task("hf", path=str(tmp_path / "train.jsonl"), heldout_size=5, seed=1, system_prompt="Be brief.")
    again = load_task("hf", path=str(tmp_path / "train.jsonl"), heldout_size=5, seed=1, system_prompt="Be brief.")
    held = [e["prompt"] for e in first.heldout]
    assert held == [e["prompt"] for e in again.heldout] and len(held) == 5
    train = [e["prompt"] for e in first.train]
    assert not set(held) & set(train)  # training never draws a held-out prompt, repeated or not
    assert len(train) in (15, 16)  # 21 rows - 5 held out (- the repeat of a held-out prompt)
    assert first.train[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": first.train[0]["prompt"]}]
    limited = load_task("hf", path=str(tmp_path / "train.jsonl"), heldout_size=5, seed=1, limit=3)
    assert len(limited.train) == 3

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", standard_rows(8))
    write_jsonl(folder / "test.jsonl", standard_rows(10)[8:])
    task = load_task("hf", path=str(folder))
    assert len(task.train) == 8 and [e["word"] for e in task.heldout] == ["w8", "w9"]
    no_test = load_task("hf", path=str(folder), test_split=None, heldout_size=2)
    assert len(no_test.train) == 6


@pytest.mark.parametrize("rows, field, expected", [
    (standard_rows(), "text", r"has no column 'text' \(its columns: prompt, word, answer\); set data.prompt_field="),
    ([{"text": f"w{i}?", "word": f"w{i}"} for i in range(5)], "text", None),  # any string column is a fine prompt
    ([{**r, "n": 1} for r in standard_rows()], "n", r"column 'n' holds int values .* not a string or a list"),
    ([{**r, "question": "q"} for r in standard_rows()], "prompt", r"column 'question' has a name grpo uses"),
    ([{"prompt": None if i == 3 else f"p{i}"} for i in range(5)], "prompt", r"1 rows have no 'prompt' \(null\)"),
])
def test_bad_prompt_columns_are_named(tmp_path, rows, field, expected):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    if expected is None:
        assert load_task("hf", path=str(path), prompt_field=field, heldout_size=2).train[0]["question"].startswith("w")
        return
    with pytest.raises(DataError, match=expected):
        load_task("hf", path=str(path), prompt_field=field, heldout_size=2)


def test_a_hub_name_without_network_fails_fast_with_the_local_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("grpo_cli.data.hf._hub_reachable", lambda endpoint: False)
    with pytest.raises(DataError, match=r"openai/gsm8k is not a local file or folder, and the hub .* cannot be "
                                        r"reached .*save_to_disk\('DIR'\).*set data.path=DIR"):
        # load_task's own first parameter is `name`: the data config's `name` goes through build_task
        build_task(OmegaConf.merge(OmegaConf.load(CONF_DIR / "data" / "hf.yaml"), {"path": "openai/gsm8k",
                                                                                   "name": "main"}))


# ---- the reward: user functions as TRL calls them ----------------------------------------------

def test_trl_documented_format_reward_runs_unchanged(tmp_path):
    (tmp_path / "trl_rewards.py").write_text(TRL_FORMAT_REWARD)
    reward = CustomReward([f"{tmp_path}/trl_rewards.py:format_reward_func"], weights=None, timeout_s=None,
                          worker="process")
    # the documentation's own test case, as our combiner hands it over: conversational prompts, text completions
    prompts = [[{"role": "assistant", "content": "What is the result of (1 + 2) * 4?"}],
               [{"role": "assistant", "content": "What is the result of (3 + 1) * 2?"}]]
    texts = ["<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think><answer>(1 + 2) * 4 = 12"
             "</answer>", "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."]
    examples = [{"messages": p, "question": p[-1]["content"], "prompt": p} for p in prompts]
    ids = torch.tensor([[1] * 20 + [0, 0], [2] * 22])  # [2, 22]: 20 and 22 tokens, the first right-padded
    mask = torch.tensor([[1] * 20 + [0, 0], [1] * 22])
    prompt = torch.ones(2, 1, dtype=torch.long)
    result = score(reward, examples, Rollout(prompt, prompt, ids, mask, texts, [False, False]))
    assert result.per_function == {"format_reward_func": [1.0, 0.0]} and result.failures == 0  # as TRL's docs say


def test_custom_reward_mixes_builtins_with_user_code_and_takes_async_functions(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "async def shout(prompts, completions, **kwargs):\n"
        "    return [1.0 if c.isupper() else 0.0 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = CustomReward(["mine.shout", "accuracy", "format", f"{tmp_path}/mine.py:shout"], [2.0, 1.0, 0.1, 1.0],
                          timeout_s=None, worker="process")
    assert list(reward.weights) == ["shout", "accuracy", "format", "shout_2"]  # a second `shout` gets _2
    out = reward(["q", "q"], ["YES 7", "no 8"], {"answer": ["7", "7"]})
    # YES 7: 2 x 1 (shout) + 1 x 1 (accuracy) + 0.1 x 0 (format) + 1 x 1 (shout_2) = 4.0; no 8: 0 + 0 + 0 + 0
    assert out.rewards == [4.0, 0.0] and out.failures == 0


def test_a_reward_that_needs_a_missing_column_is_named():
    answerless = {"messages": [], "question": "q", "prompt": "q", "word": "w"}
    with pytest.raises(ConfigError, match=r"reward function 'accuracy' needs column 'answer', which the data does "
                                          r"not have \(it has: word, completion_length, truncated, completion_ids\)"):
        check_columns(load_reward("arithmetic"), answerless)
    check_columns(load_reward("arithmetic"), {**answerless, "answer": "1"})
    check_columns(OutcomeReward({"any": lambda prompts, completions, **_: [0.0] * len(completions)},
                                weights=None, timeout_s=10.0, worker="process"), answerless)


def load_reward(name: str):
    return build(OmegaConf.load(CONF_DIR / "reward" / f"{name}.yaml"))


# ---- bad input: one line, exit 2, before the model loads ---------------------------------------

# a model loader that leaves a mark: its absence proves the error came before the model load
LOADER = ["model.loader._target_=loader.load"]


STANDARD = ["data=hf", "data.path=standard.jsonl", "data.heldout_size=2"]
RECORD = ["reward=custom", "reward.funcs=[my_rewards.record]"]


# each case is a CLI start (~7 s): the ones marked slow run with `make test-all`
@pytest.mark.parametrize("args, expected", [
    ([*STANDARD, *RECORD], None),  # the control: good input reaches the model load
    pytest.param(["data=hf", "data.path=missing.jsonl", *RECORD], r"data.path \(missing.jsonl\) does not exist",
                 marks=pytest.mark.slow),
    pytest.param([*STANDARD, "data.prompt_field=text", *RECORD],
     r"standard.jsonl has no column 'text' \(its columns: prompt, word, answer\)", marks=pytest.mark.slow),
    pytest.param(["data=hf", "data.path=numbers.jsonl", *RECORD], r"column 'prompt' holds int values",
                 marks=pytest.mark.slow),
    ([*STANDARD, "reward=custom", "reward.funcs=[nowhere.fn]"],
     r"reward.funcs\[0\]: no module named 'nowhere' in the working folder \(.+\) or on sys.path"),
    pytest.param([*STANDARD, "reward=custom", "reward.funcs=[my_rewards.nothing]"],
     r"my_rewards has no 'nothing' \(its functions: .*record", marks=pytest.mark.slow),
    pytest.param([*STANDARD, "reward=custom", "reward.funcs=[missing.py:fn]"],
                 r"reward.funcs\[0\]: missing.py does not exist", marks=pytest.mark.slow),
    ([*STANDARD, "reward=custom", "reward.funcs=[my_rewards.no_kwargs]"],
     r"my_rewards.no_kwargs takes \(prompts, completions\), but .*\*\*kwargs"),
    pytest.param([*STANDARD, "reward=custom", "reward.funcs=[my_rewards.record,accuracy]", "reward.weights=[1.0]"],
     r"reward.weights \(\[1.0\]\) must be a list of numbers, one per function of reward.funcs \(2: ",
                 marks=pytest.mark.slow),
    (["data=hf", "data.path=chat.parquet", "data.heldout_size=2", "reward=arithmetic"],
     r"reward function 'accuracy' needs column 'answer', which the data does not have"),
])
def test_bad_input_is_one_line_before_the_model_loads(workdir, args, expected):
    write_jsonl(workdir / "numbers.jsonl", [{"prompt": i} for i in range(5)])
    (workdir / "loader.py").write_text("import pathlib\ndef load(**kwargs):\n    pathlib.Path('LOADED').touch()\n"
                                       "    raise SystemExit(3)\n")
    out = grpo("train", *TINY, *LOADER, *args, "hydra.run.dir=run", cwd=workdir)
    if expected is None:
        assert out.returncode == 3 and (workdir / "LOADED").exists(), out.stderr[-3000:]
        return
    assert re.search(expected, one_line_error(out)), out.stderr
    assert not (workdir / "LOADED").exists()


def test_eval_and_sample_check_the_data_and_reward_before_the_model_loads(workdir):
    (workdir / "loader.py").write_text("import pathlib\ndef load(**kwargs):\n    pathlib.Path('LOADED').touch()\n")
    for command in ("eval", "sample"):
        out = grpo(command, "model=tiny", *LOADER, "data=hf", "data.path=chat.parquet", "data.heldout_size=2",
                   "reward=custom", "reward.funcs=[my_rewards.no_kwargs]", "hydra.run.dir=out", cwd=workdir)
        assert "my_rewards.no_kwargs takes (prompts, completions)" in one_line_error(out)
        assert not (workdir / "LOADED").exists()


def test_a_hub_name_without_network_is_one_line_in_seconds(workdir, monkeypatch):
    from huggingface_hub import constants

    start = time.perf_counter()
    # an endpoint that refuses at once stands for "no network" wherever the test runs; set where the hub client keeps
    # it (it reads HF_ENDPOINT once, at import), so the command runs in this process rather than a child
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    out = run_cli(["train", *TINY, "data=hf", "data.path=openai/gsm8k", "data.name=main", "hydra.run.dir=run"],
                  cwd=workdir, env={"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"})
    line = one_line_error(out)
    assert "openai/gsm8k is not a local file or folder, and the hub (http://127.0.0.1:9) cannot be reached" in line
    assert "set data.path=DIR" in line
    assert time.perf_counter() - start < 60  # the hub client alone retries for ~25 s; we check for 3 s at most


@pytest.mark.slow  # the installed console script, a process (~12 s): make test-ci
@pytest.mark.ci
def test_the_console_script_imports_reward_modules_from_the_working_directory(workdir):
    script = Path(sys.executable).with_name("grpo")
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    out = subprocess.run([str(script), "train", *TINY, "data=hf", "data.path=standard.jsonl", "data.heldout_size=2",
                          "reward=custom", "reward.funcs=[my_rewards.no_kwargs]", "hydra.run.dir=run"],
                         cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    # the module imported (its function's signature is what is wrong), so the working directory was on sys.path
    assert "my_rewards.no_kwargs takes (prompts, completions)" in one_line_error(out)
