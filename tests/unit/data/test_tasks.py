"""Tasks in grpo_cli.data: the arithmetic generator, GSM8K and JSONL loading, held-out disjointness,
and the messages bad settings and bad data produce."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_cli.config import compose, validate
from grpo_cli.data import ArithmeticTask, EnvTask, GSM8KTask, HFTask, JsonlTask, load_task, solve
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.resources import CONF_DIR

STEP = re.compile(r"^(-?\d+) ([-+*]) (\d+) = (-?\d+)$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_solution(example):
    """Every step line is true arithmetic and the last line is '#### answer'."""
    *steps, last = example["solution"].split("\n")
    assert last == f"#### {example['answer']}"
    for line in steps:
        a, op, b, c = STEP.match(line).groups()
        assert OPS[op](int(a), int(b)) == int(c), line
    return steps


# ---- arithmetic -------------------------------------------------------------------------------

def test_solve_shows_the_steps():
    # 3 + 4 * 5: * first -> 4 * 5 = 20, then 3 + 20 = 23
    assert solve([3, 4, 5], ["+", "*"]) == (23, ["4 * 5 = 20", "3 + 20 = 23"])
    # left to right (word style) -> (3 + 4) * 5 = 35
    assert solve([3, 4, 5], ["+", "*"], precedence=False) == (35, ["3 + 4 = 7", "7 * 5 = 35"])
    # 10 - 2 * 3 * 2 + 1: 2 * 3 = 6, 6 * 2 = 12, 10 - 12 = -2, -2 + 1 = -1
    assert solve([10, 2, 3, 2, 1], ["-", "*", "*", "+"])[0] == -1


def test_arithmetic_is_a_function_of_seed_and_index():
    a, b, c = load_task("arithmetic", seed=3), load_task("arithmetic", seed=3), load_task("arithmetic", seed=4)
    first = [a.train[i]["question"] for i in range(50)]
    assert first == [b.train[i]["question"] for i in range(50)]
    assert a.heldout == b.heldout
    assert first != [c.train[i]["question"] for i in range(50)]
    assert [e["question"] for e in a.heldout] != [e["question"] for e in c.heldout]
    # item i does not depend on what was read before it; negative indices and slices work
    assert load_task("arithmetic", seed=3).train[777] == a.train[777] == a.train[-(len(a.train) - 777)]
    assert a.train[5:8] == [a.train[5], a.train[6], a.train[7]]
    assert len(a.train) == 100000 and len(a.heldout) == 500
    with pytest.raises(IndexError):
        a.train[100000]


def test_arithmetic_answers_recomputed_from_the_question():
    task = load_task("arithmetic", num_operands=3, operators=["+", "-", "*"], train_size=300)
    for example in list(task.train) + task.heldout[:100]:
        expr = re.fullmatch(r"What is ([-+* \d]+)\?", example["question"]).group(1)
        # Python's own precedence is the one the questions promise
        assert int(example["answer"]) == eval(expr)
        check_solution(example)
        # the default instruction wraps the question: "{question} Answer with just the number."
        assert example["messages"] == [{"role": "user", "content": task.instruction.replace("{question}",
                                                                                            example["question"])}]
        assert example["question"] in example["messages"][0]["content"]
        assert set(example) == {"messages", "question", "answer", "solution"}


def test_arithmetic_train_and_heldout_disjoint():
    task = load_task("arithmetic", few_shot=3, min_digits=2)  # exactly 2 digits: 90 x 90 = 8,100 problems
    held = {e["question"] for e in task.heldout}
    shots = {q for q, _ in task.shots}
    assert len(held) == 500 and len(shots) == 3 and not held & shots
    train = {task.train[i]["question"] for i in range(20000)}
    assert not train & held and not train & shots
    # 20,000 draws from 8,100 problems minus 503 reserved: nearly all the rest show up
    assert len(train) > 7000


def test_arithmetic_difficulty_knobs():
    task = load_task("arithmetic", num_operands=4, min_digits=3, max_digits=3, operators=["-"])
    for i in range(100):
        numbers = re.findall(r"\d+", task.train[i]["question"])
        assert len(numbers) == 4 and all(len(n) == 3 for n in numbers)
    mixed = load_task("arithmetic", min_digits=1, max_digits=3)
    lengths = {len(n) for i in range(300) for n in re.findall(r"\d+", mixed.train[i]["question"])}
    assert lengths == {1, 2, 3}
    assert load_task("arithmetic", style="expression").train[0]["question"].endswith(" = ?")


def test_arithmetic_word_style():
    task = load_task("arithmetic", style="word", num_operands=3, operators=["+", "-"])
    for i in range(200):
        example = task.train[i]
        question = example["question"]
        assert re.match(r"[A-Z][a-z]+ has \d+ [a-z]+\.", question) and "How many" in question
        steps = check_solution(example)
        # told in order: the first step starts from the first number, each next from the last result
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        assert int(STEP.match(steps[0]).group(1)) == numbers[0]
        assert [int(STEP.match(s).group(3)) for s in steps] == numbers[1:]
        # a story never gives away more than there is
        assert all(int(STEP.match(s).group(4)) >= 0 for s in steps)


def test_arithmetic_prompt_settings():
    task = load_task("arithmetic", few_shot=2, system_prompt="Be brief.",
                     instruction="{question} Answer with just the number, as #### {N}.")
    messages = task.train[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"] == "Be brief."
    assert messages[2]["content"].endswith(f"#### {eval(task.shots[0][0][8:-1])}")
    # braces other than {question} stay as written
    assert messages[-1]["content"] == task.train[0]["question"] + " Answer with just the number, as #### {N}."
    # the shots are the same for every prompt
    assert task.train[1]["messages"][:5] == messages[:5]


@pytest.mark.parametrize("override, field", [
    ({"num_operands": 1}, "data.num_operands"),
    ({"min_digits": 0}, "data.min_digits"),
    ({"min_digits": 3, "max_digits": 2}, "data.max_digits"),
    ({"operators": ["/"]}, "data.operators"),
    ({"operators": []}, "data.operators"),
    ({"style": "poem"}, "data.style"),
    ({"train_size": 0}, "data.train_size"),
    ({"heldout_size": 0}, "data.heldout_size"),
    ({"few_shot": -1}, "data.few_shot"),
    ({"instruction": "Solve it."}, "data.instruction"),
    # 1-digit pairs: 9 * 9 = 81 problems, so at most 40 may be held out
    ({"min_digits": 1, "max_digits": 1, "heldout_size": 41}, "data.heldout_size"),
])
def test_arithmetic_bad_settings_name_the_field(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)) as err:
        load_task("arithmetic", **override)
    assert "set data." in str(err.value) or "raise data." in str(err.value)


def test_arithmetic_smallest_space_still_works():
    task = load_task("arithmetic", min_digits=1, max_digits=1, heldout_size=40)
    held = {e["question"] for e in task.heldout}
    assert not {e["question"] for e in task.train[:2000]} & held


# ---- GSM8K ------------------------------------------------------------------------------------

def test_gsm8k_shared_file(gsm8k_path):
    task = load_task("gsm8k", path=str(gsm8k_path))
    assert len(task.train) + len(task.heldout) == 7473
    assert len(task.heldout) == 200
    assert not {e["question"] for e in task.train} & {e["question"] for e in task.heldout}
    for example in task.train + task.heldout:
        assert re.fullmatch(r"-?\d+", example["answer"]), example["answer"]
        assert example["solution"].rstrip().endswith(example["solution"].split("####")[-1].strip())
    natalia = next(e for e in task.train + task.heldout if e["question"].startswith("Natalia sold clips"))
    assert natalia["answer"] == "72" and "<<48/2=24>>" in natalia["solution"]
    assert natalia["messages"][-1]["content"].startswith(natalia["question"] + "\nSolve step by step")
    # the same seed carves the same held-out slice
    assert load_task("gsm8k", path=str(gsm8k_path)).heldout == task.heldout


def test_gsm8k_limit_and_few_shot(gsm8k_path):
    assert len(load_task("gsm8k", path=str(gsm8k_path), limit=50).train) == 50
    task = load_task("gsm8k", path=str(gsm8k_path), few_shot=2)
    # 7473 - 200 held out - 2 shots
    assert len(task.train) == 7271
    shots = {q for q, _ in task.shots}
    assert not shots & {e["question"] for e in task.train + task.heldout}
    assert all("<<" not in reply and "####" in reply for _, reply in task.shots)
    assert [m["role"] for m in task.train[0]["messages"]] == ["user", "assistant", "user", "assistant", "user"]


def test_gsm8k_answer_parsing(tmp_path):
    rows = [{"question": f"Q{i}?", "answer": f"Work {i}\n#### {i}"} for i in range(10)]
    rows[3]["answer"] = "10 * 100 = <<10*100=1000>>1000\n#### 1,000"
    rows[4]["answer"] = "A #### note inside.\n#### -5 "
    task = load_task("gsm8k", path=str(write_jsonl(tmp_path / "g.jsonl", rows)), heldout_size=1, seed=1)
    answers = {e["question"]: e["answer"] for e in task.train + task.heldout}
    # "#### 1,000" -> "1000"; the last '####' wins -> "-5"
    assert answers["Q3?"] == "1000" and answers["Q4?"] == "-5" and answers["Q7?"] == "7"
    assert {e["question"]: e["solution"] for e in task.train + task.heldout}["Q3?"] == rows[3]["answer"]


def test_gsm8k_folder_with_test_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"question": f"T{i}", "answer": f"#### {i}"} for i in range(20)])
    # T5 is also in the test split (with other spacing): it must leave train
    test = [{"question": "E1", "answer": "#### 1"}, {"question": " T5 ", "answer": "#### 5"}]
    write_jsonl(tmp_path / "test.jsonl", test)
    task = load_task("gsm8k", path=str(tmp_path), heldout_size=7)
    assert [e["question"] for e in task.heldout] == ["E1", " T5 "]
    assert len(task.train) == 19 and "T5" not in {e["question"] for e in task.train}


def test_gsm8k_from_the_hub_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"pip install datasets; or set data.path="):
        load_task("gsm8k")


def test_gsm8k_from_the_hub(monkeypatch):
    monkeypatch.setattr("grpo_cli.data.hf._hub_reachable", lambda endpoint: True)  # the fake hub needs no network
    hub = {"train": [{"question": f"Q{i}", "answer": f"#### {i}"} for i in range(30)],
           "test": [{"question": "E", "answer": "#### 2,000"}]}
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, config: hub))
    task = load_task("gsm8k")
    assert len(task.train) == 30 and task.heldout[0]["answer"] == "2000"

    def offline(name, config):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"could not load openai/gsm8k .*no network.*set data.path="):
        load_task("gsm8k")


# ---- JSONL ------------------------------------------------------------------------------------

def test_jsonl_custom_fields_and_answer_regex(tmp_path):
    rows = [{"problem": f"P{i}", "output": f"steps\n#### {i},500", "work": f"w{i}"} for i in range(12)]
    rows[2]["output"] = "no final answer here"
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    task = load_task("jsonl", path=str(path), question_field="problem", answer_field="output",
                     solution_field="work", answer_regex=r"####\s*(.+)$", heldout_size=2)
    examples = {e["question"]: e for e in task.train + task.heldout}
    # P2 has no '####': skipped and counted; "1,500" -> "1500"
    assert task.skipped == 1 and len(examples) == 11 and "P2" not in examples
    assert examples["P1"]["answer"] == "1500" and examples["P1"]["solution"] == "w1"
    assert len(task.heldout) == 2


def test_jsonl_plain_answers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": f"q{i}", "answer": i * 2} for i in range(5)])
    task = load_task("jsonl", path=str(path), heldout_size=1)
    example = next(e for e in task.train if e["question"] == "q3")
    # a number becomes its string; no solution field -> no solution key
    assert example["answer"] == "6" and "solution" not in example


# ---- bad data: the message names the file, the line and the fix ------------------------------

def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=re.escape(f"{missing} does not exist; set data.path=")):
        load_task("gsm8k", path=str(missing))
    with pytest.raises(DataError, match=r"holds no train.jsonl.*set data.path="):
        load_task("jsonl", path=str(tmp_path))


def test_malformed_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n')
    with pytest.raises(DataError, match=re.escape(f"{path}:3: not valid JSON: ")):
        load_task("gsm8k", path=str(path))
    path.write_text('{"question": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: expected one JSON object per line, got list")):
        load_task("jsonl", path=str(path))


def test_missing_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "1"}, {"problem": "b", "answer": "2"}])
    with pytest.raises(DataError,
                       match=re.escape(f"{path}:2: missing field 'question'; set data.question_field=")):
        load_task("jsonl", path=str(path))
    with pytest.raises(DataError, match=re.escape(f"{path}:2: missing field 'question'; GSM8K lines hold")):
        load_task("gsm8k", path=str(path))
    with pytest.raises(DataError, match=re.escape(f"{path}:1: missing field 'steps'; set data.solution_field=")):
        load_task("jsonl", path=str(path), solution_field="steps")


def test_empty_after_limit_or_filter(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)])
    with pytest.raises(DataError, match=re.escape(f"{path} has no training examples after") + ".*data.limit=0"):
        load_task("jsonl", path=str(path), heldout_size=1, limit=0)
    with pytest.raises(DataError, match=re.escape(f"{path} has no examples after answer extraction")):
        load_task("jsonl", path=str(path), answer_regex=r"ANSWER: (\d+)")
    # 5 problems cannot give 5 held out and still train on something
    with pytest.raises(DataError, match=r"no training examples after removing 5 held-out"):
        load_task("jsonl", path=str(path), heldout_size=5)
    with pytest.raises(ConfigError, match=r"data.answer_regex .* not a valid regular expression"):
        load_task("jsonl", path=str(path), answer_regex="(")
    with pytest.raises(ConfigError, match=r"data.limit \(-1\) must be an integer >= 0 or null"):
        load_task("jsonl", path=str(path), limit=-1)


# ---- every conf/data/*.yaml builds ------------------------------------------------------------

def write_game(folder):
    """A file holding an environment class that writes its prompt from the row's seed (data=env's rows)."""
    path = folder / "game.py"
    path.write_text('class Game:\n    def reset(self, seed, **row):\n        return f"Game {seed}."\n\n'
                    '    def guess(self, n: int) -> str:\n        """Guess.\n\n        Args:\n'
                    '            n: the guess\n        """\n        return "lower"\n')
    return path


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml")))
def test_every_data_config_instantiates(name, tmp_path, request):
    node = OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml")
    if name == "gsm8k":
        node.path = str(request.getfixturevalue("gsm8k_path"))
        node.limit = 20
    if name in ("jsonl", "hf"):
        rows = [{"question" if name == "jsonl" else "prompt": f"q{i}", "answer": i} for i in range(300)]
        node.path = str(write_jsonl(tmp_path / "p.jsonl", rows))
    # data=env's rows have no prompt: it runs with an environment class (a real one, so its checks pass)
    env = ["env=class", f"env.factory={write_game(tmp_path)}:Game"] if name == "env" else []
    # the keys are parameters of the class: `grpo train`'s own checks, before building anything, pass
    validate(compose("train", [f"data={name}", *env,
                               *(f"data.{k}={v}" for k, v in node.items() if k in ("path", "limit"))]))
    task = instantiate(node)
    assert isinstance(task, (ArithmeticTask, EnvTask, GSM8KTask, HFTask, JsonlTask)) and task.train and task.heldout
    # every example has its chat messages and question; an answer except data=env's (the environment scores)
    assert {"messages", "question"} | ({"answer"} if name != "env" else set()) <= set(task.train[0])
    assert task.train[0]["messages"][-1]["role"] == "user"
