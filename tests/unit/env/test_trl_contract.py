"""TRL's environment_factory contract as TRL has it now (docs/environments.md, the table): a TRL-style environment
class runs unchanged. `get_reward` is a reward source, not a tool; instances are pooled, `reset` between episodes
and closed at the end; `reset(**row)` gets the dataset row as it is; async methods run on one event loop for the
run; plain tools join the environment's methods; a dict of factories is chosen per row by a column."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo_cli.env import ClassEnv, choose, prepare, run_episodes
from grpo_cli.env.limits import Limits
from grpo_cli.errors import ConfigError
from grpo_cli.policy import char_tokenizer
from grpo_cli.rewards.call import score
from grpo_cli.rewards.result import RewardResult

GAME_PY = '''
import asyncio


class Secret:
    """A TRL-style environment: guess the row's secret word; the environment scores itself."""

    built = []
    closed = []
    loops = set()

    def __init__(self):
        Secret.built.append(self)
        self.resets = 0

    def reset(self, **row):
        self.row, self.solved = row, False
        self.resets += 1
        return None

    async def guess(self, word: str) -> str:
        """Guess the secret word.

        Args:
            word: the guess
        """
        Secret.loops.add(id(asyncio.get_running_loop()))
        self.solved = word == self.row["secret"]
        return "correct" if self.solved else "wrong"

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def close(self) -> None:
        Secret.closed.append(self)


class Counter:
    """A second environment for the per-row choice."""

    def reset(self, **row):
        self.total = 0
        return " Count."

    def add(self, n: int) -> str:
        """Add to the total.

        Args:
            n: how much
        """
        self.total += n
        return str(self.total)


def shout(text: str) -> str:
    """Shout a text.

    Args:
        text: what to shout
    """
    return text.upper()
'''

TOK = char_tokenizer()


@pytest.fixture()
def game(tmp_path, monkeypatch):
    (tmp_path / "trl_game.py").write_text(GAME_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trl_game", raising=False)
    import trl_game

    return trl_game


def env(factory, **kwargs) -> ClassEnv:
    return ClassEnv(factory, "auto", 4, 8, 2048, 10, 4000, **kwargs)


def example(secret: str, **extra) -> dict:
    """An example as the data gives it: grpo's own `messages` and `question`, and the dataset's columns."""
    return {"messages": [{"role": "user", "content": "Guess the word."}], "question": "Guess the word.",
            "prompt": "Guess the word.", "secret": secret, **extra}


class Scripted:
    """Each row answers with its next scripted text (its EOS appended), the row found by a word in its prompt."""

    eos_token_id = TOK.eos_token_id

    def __init__(self, replies: dict[str, list[str]]):
        self.replies = {k: list(v) for k, v in replies.items()}

    def continue_batch(self, sequences, max_new):
        out = []
        for seq in sequences:
            text = TOK.decode(seq)
            key = next(k for k in self.replies if k in text)
            out.append(TOK(self.replies[key].pop(0), add_special_tokens=False)["input_ids"][:max_new - 1]
                       + [TOK.eos_token_id])
        return out


def guess_call(word: str) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"word": "{word}"}}}}</tool_call>'


def test_get_reward_and_close_are_not_tools(game):
    secret = env("trl_game.Secret")
    assert [s["function"]["name"] for s in secret.schemas] == ["guess"]
    _, boxes = prepare(secret, [example("apple")])
    assert list(boxes[0].tools) == ["guess"]


def test_reset_receives_the_dataset_row_unchanged(game):
    # the row as the dataset gives it: its prompt as given and every other column; not grpo's chat messages or
    # the question text it derives for logs
    prompts, boxes = prepare(env("trl_game.Secret"), [example("apple", level=3)])
    assert boxes[0].environment.row == {"prompt": "Guess the word.", "secret": "apple", "level": 3}
    assert prompts == [[{"role": "user", "content": "Guess the word."}]]


def test_instances_are_pooled_and_reset_between_episodes_and_closed_at_the_end(game):
    secret = env("trl_game.Secret")
    built = len(game.Secret.built)  # the contract check builds one
    for _ in range(3):  # three batches of four episodes
        _, boxes = prepare(secret, [example("apple")] * 4)
        assert len({id(b.environment) for b in boxes}) == 4
    # two batches' instances serve every batch (a batch's are given back two batches later, once its rewards have
    # read them): each reset once per episode, none built per episode
    assert len(game.Secret.built) - built <= 8
    assert sum(i.resets for i in game.Secret.built) == 12
    assert game.Secret.closed == []
    secret.close()
    assert sorted(map(id, game.Secret.closed)) == sorted(map(id, game.Secret.built))
    secret.close()  # once only
    assert len(game.Secret.closed) == len(game.Secret.built)


def run(secret: ClassEnv, examples: list[dict], replies: dict[str, list[str]]):
    prompts, boxes = prepare(secret, examples)
    fmt = choose("auto", TOK, secret.schemas)
    return run_episodes(Scripted(replies), TOK, fmt, prompts, boxes, Limits(4, 8, 2048, 10.0, 4000))


def test_get_reward_is_a_reward_source_summed_with_the_reward_functions(game):
    secret = env("trl_game.Secret")
    examples = [example("apple"), example("pear", prompt="Guess the fruit.",
                                           messages=[{"role": "user", "content": "Guess the fruit."}])]
    episodes = run(secret, examples, {"the word.": [guess_call("apple"), "done"],
                                      "the fruit.": [guess_call("plum"), "done"]})
    assert [e.environment_reward for e in episodes] == [1.0, 0.0]

    def half(prompts, completions, columns):  # the run's own reward: 0.5 for every completion
        return RewardResult([0.5] * len(completions), {"half": [0.5] * len(completions)})

    from grpo_cli.rollout.episodes import as_rollout

    result = score(half, examples, as_rollout(episodes, TOK))
    # TRL's rule: the environment's score is one more reward source, weight 1, named after its class
    assert result.rewards == [1.5, 0.5]
    assert result.per_function == {"half": [0.5, 0.5], "Secret": [1.0, 0.0]}


def test_async_methods_share_one_event_loop_for_the_run(game):
    secret = env("trl_game.Secret")
    fruit = example("apple", prompt="Guess the fruit.", messages=[{"role": "user", "content": "Guess the fruit."}])
    for word in ("apple", "plum"):
        run(secret, [example("apple"), fruit], {"the word.": [guess_call(word), "done"],
                                               "the fruit.": [guess_call(word), "done"]})
    assert len(game.Secret.loops) == 1  # four calls, two batches: one loop


def test_tools_and_a_factory_together(game):
    both = env("trl_game.Secret", tools=["trl_game.shout"])
    assert sorted(s["function"]["name"] for s in both.schemas) == ["guess", "shout"]
    _, boxes = prepare(both, [example("apple")])
    assert sorted(boxes[0].tools) == ["guess", "shout"]


def test_a_dict_of_factories_is_chosen_per_row_by_a_column(game):
    both = env({"secret": "trl_game.Secret", "counter": "trl_game.Counter"})
    prompts, boxes = prepare(both, [example("apple", environment="secret"), example("x", environment="counter")])
    assert isinstance(boxes[0].environment, game.Secret) and isinstance(boxes[1].environment, game.Counter)
    # only the row's own environment's tools are shown and callable
    assert list(boxes[0].tools) == ["guess"] and list(boxes[1].tools) == ["add"]
    assert prompts[1] == [{"role": "user", "content": "Guess the word. Count."}]
    assert boxes[1].environment.__dict__.get("row") is None  # Counter keeps no row; the column reached reset
    with pytest.raises(ConfigError) as err:
        prepare(both, [example("apple", environment="chess")])
    assert "env.factory_column" in str(err.value) and "'chess'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        prepare(both, [example("apple")])
    assert "has no column 'environment'" in str(err.value)


@pytest.mark.slow  # a fresh interpreter's exit (~6 s): make test-ci
@pytest.mark.ci
def test_every_instance_is_closed_when_the_command_ends_without_an_explicit_close(game, tmp_path):
    script = ("import trl_game\nfrom grpo_cli.env import ClassEnv, prepare\n"
              "trl_game.Secret.close = lambda self: open('closed.txt', 'a').write('closed\\n')\n"
              "env = ClassEnv('trl_game.Secret', 'auto', 4, 8, 512, 10, 1000)\n"
              "prepare(env, [{'prompt': 'p', 'secret': 'a'}] * 3)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "closed.txt").read_text() == "closed\n" * 3  # the three instances of the pool, once each


def test_two_batches_sampled_before_they_are_scored_keep_their_own_instances(game):
    # grpo eval samples the greedy and the sampled episodes of a batch, then scores both: the first batch's
    # instances must still hold their episodes when the rewards read them
    secret = env("trl_game.Secret")
    _, greedy = prepare(secret, [example("apple")] * 2)
    _, sampled = prepare(secret, [example("pear")] * 2)
    assert [b.environment.row["secret"] for b in greedy + sampled] == ["apple", "apple", "pear", "pear"]
    assert not {id(b.environment) for b in greedy} & {id(b.environment) for b in sampled}


def test_the_environments_scores_of_two_rollouts_join_as_one_column(game):
    from grpo_cli.policy import pad_id
    from grpo_cli.rollout import Rollout
    from grpo_cli.rollout.episodes import as_rollout

    secret = env("trl_game.Secret")
    first = as_rollout(run(secret, [example("apple")], {"the word.": [guess_call("apple"), "done"]}), TOK)
    second = as_rollout(run(secret, [example("apple")], {"the word.": [guess_call("plum"), "done"]}), TOK)
    both = Rollout.cat([first, second], pad=pad_id(TOK))  # as grpo eval joins its greedy and sampled rollouts

    def nothing(prompts, completions, columns):
        return RewardResult([None] * len(completions), {})

    result = score(nothing, [example("apple")], both)
    assert result.rewards == [1.0, 0.0] and result.per_function == {"Secret": [1.0, 0.0]}
