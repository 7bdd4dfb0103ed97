"""TRL's environment_factory contract: an instance per running episode, reset(**row) first (its observation joins the
prompt), the public methods are the tools; a class that breaks the contract is one line before the model loads."""

from __future__ import annotations

import sys

import pytest

from grpo_cli.env import ClassEnv, prepare
from grpo_cli.errors import ConfigError

GAME_PY = '''
class Counter:
    """A TRL-style environment: count up to the row's target."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.value = 0
        self.row = None

    def reset(self, **row):
        self.row, self.value = row, 0
        return f" Reach {row['target']}."

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: how much to add
        """
        self.value += n
        return str(self.value)

    def _private(self) -> None:
        pass


class Quiet(Counter):
    def reset(self, **row):
        self.row = row


class NoReset:
    def add(self, n: int) -> str:
        """Add.

        Args:
            n: how much
        """
        return str(n)


class Undocumented(Counter):
    def peek(self, k: int) -> int:
        return k


class Broken:
    def __init__(self):
        raise RuntimeError("no server")


class PickyReset(Counter):
    def reset(self, target):
        return None


class Owner(Counter):
    """Writes its own prompt (environment-owned data): reset(seed, **row) returns it."""

    def reset(self, seed, **row):
        self.row, self.value = {"seed": seed, **row}, 0
        return f"Reach {seed * 2}."


class Demonstrates(Counter):
    """Writes its prompt as turns: a demonstrated call, its result, then the question."""

    def reset(self, seed, **row):
        self.row, self.value = {"seed": seed, **row}, 0
        return [{"role": "user", "content": "Reach 1."},
                {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"n": 1}}</tool_call>'},
                {"role": "tool", "content": "1"},
                {"role": "user", "content": f"Reach {seed}."}]


class Chatty(Counter):
    def reset(self, seed, **row):
        return [{"role": "user", "content": "Reach 1."}, {"role": "assistant", "content": "Done."}]


class Board(Counter):
    """A property that needs reset() first, as many TRL environments have: reading it before raises."""

    @property
    def target(self) -> int:
        if self.row is None:
            raise RuntimeError("call reset() first")
        return self.row["target"]

    @classmethod
    def rules(cls, k: int) -> str:
        """The rules.

        Args:
            k: which rule
        """
        return str(k)

    @staticmethod
    def helper(k: int) -> int:
        return k
'''


@pytest.fixture()
def game_py(tmp_path, monkeypatch):
    (tmp_path / "game.py").write_text(GAME_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "game", raising=False)
    return tmp_path


def env(factory: str) -> ClassEnv:
    return ClassEnv(factory, "auto", 4, 8, 512, 10, 4000)


def test_each_episode_gets_its_own_instance_reset_with_its_row(game_py):
    counter = env("game.Counter")
    rows = [{"prompt": "Count.", "target": 3}, {"prompt": [{"role": "user", "content": "Count."}], "target": 5}]
    prompts, boxes = prepare(counter, rows)
    instances = [b.environment for b in boxes]
    assert instances[0] is not instances[1]
    assert [i.row for i in instances] == rows  # every column, the prompt included, as keywords
    # the first observation joins the prompt's last message, as TRL appends it
    assert prompts == [[{"role": "user", "content": "Count. Reach 3."}],
                       [{"role": "user", "content": "Count. Reach 5."}]]
    assert rows[1]["prompt"][0]["content"] == "Count."  # the row itself is left as it was
    # public methods are the tools, reset and _private are not; each instance's own method is called
    assert list(boxes[0].tools) == ["add"]
    boxes[0].tools["add"].fn(n=2)
    assert [i.value for i in instances] == [2, 0]
    assert counter.schemas[0]["function"]["name"] == "add"


def test_a_reset_that_returns_nothing_leaves_the_prompt_as_it_is(game_py):
    prompts, _ = prepare(env("game.Quiet"), [{"prompt": "Count.", "target": 3}])
    assert prompts == [[{"role": "user", "content": "Count."}]]


@pytest.mark.parametrize("factory, expected", [
    ("game.NoReset", "env.factory (game.NoReset): NoReset has no reset method; give it def reset(self, **row)"),
    ("game.Undocumented", "env.factory (game.Undocumented): method peek: Cannot generate JSON schema for peek "
                          "because it has no docstring"),
    ("game.Broken", "env.factory (game.Broken): calling it raised RuntimeError: no server"),
    ("game.Missing", "env.factory: game has no 'Missing'"),
    ("nowhere.Game", "env.factory: no module named 'nowhere'"),
], ids=["no-reset", "method-without-docstring", "factory-raises", "no-such-class", "no-such-module"])
def test_a_class_that_breaks_the_contract_is_one_line_naming_the_fix(game_py, factory, expected):
    with pytest.raises(ConfigError) as err:
        env(factory)
    line = str(err.value)
    assert "\n" not in line and line.startswith(expected), line
    assert "reward.funcs" not in line


def test_a_reset_that_cannot_take_the_row_names_the_fix(game_py):
    with pytest.raises(ConfigError) as err:
        prepare(env("game.PickyReset"), [{"prompt": "Count.", "target": 3}])
    assert str(err.value).startswith("env.factory (game.PickyReset): reset(**row) raised TypeError")
    assert "def reset(self, **row)" in str(err.value)


def test_the_contract_check_reads_no_property(game_py):
    # Board.target raises before reset(): the check before the model loads must not read it, nor take it for a tool
    board = env("game.Board")
    assert [t["function"]["name"] for t in board.schemas] == ["add", "rules"]  # the methods, as getmembers' order
    prompts, boxes = prepare(board, [{"prompt": "Count.", "target": 3}])
    assert list(boxes[0].tools) == ["add", "rules"] and boxes[0].environment.target == 3


# ---- environment-owned prompts (data=env): the row has none, reset writes it -------------------------------------

def owned(seed: int) -> dict:
    """An example as data=env gives it: an empty user turn for the environment to fill, no prompt of its own."""
    return {"messages": [{"role": "system", "content": "Play."}, {"role": "user", "content": ""}],
            "question": f'{{"seed": {seed}}}', "prompt": None, "seed": seed}


def test_an_environment_writes_the_whole_user_turn_of_a_row_without_a_prompt(game_py):
    prompts, boxes = prepare(env("game.Owner"), [owned(3), owned(5)])
    assert prompts == [[{"role": "system", "content": "Play."}, {"role": "user", "content": "Reach 6."}],
                       [{"role": "system", "content": "Play."}, {"role": "user", "content": "Reach 10."}]]
    # reset gets the row's own columns: no prompt (there is none), nor grpo's messages and question
    assert [b.environment.row for b in boxes] == [{"seed": 3}, {"seed": 5}]


def test_an_environment_may_write_its_prompt_as_turns(game_py):
    prompts, _ = prepare(env("game.Demonstrates"), [owned(4)])
    assert [m["role"] for m in prompts[0]] == ["system", "user", "assistant", "tool", "user"]
    assert prompts[0][-1] == {"role": "user", "content": "Reach 4."}


@pytest.mark.parametrize("factory, says", [
    ("game.Quiet", "env.factory (game.Quiet): reset(**row) returned None on a row without a prompt (data=env); "
                   "return the prompt: a string (the user turn) or a list of {role, content} messages"),
    ("game.Chatty", "env.factory (game.Chatty): reset(**row) returned messages whose last has role "
                    "'assistant'; the last must be the user's turn the model answers"),
])
def test_an_environment_that_writes_no_usable_prompt_is_one_line(game_py, factory, says):
    with pytest.raises(ConfigError) as err:
        prepare(env(factory), [owned(1)])
    assert str(err.value) == says
