"""examples/guess_number: the game's rules and the arithmetic its README rests on (binary search wins every secret
of 1-15 in 4 guesses; a policy that ignores the feedback wins at most 4 of 15), the demonstrated game's call as the
episode reads it, the rows as data=env loads them, and the report's counts on hand-built episodes."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from grpo_cli.config import compose
from grpo_cli.env.formats import CHATML_TOOLS_TEMPLATE, ToolFormat
from grpo_cli.instantiate import build
from tests.helpers import REPO

HERE = REPO / "examples" / "guess_number"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"guess_number_example_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


game, reward, run = load("guess_game"), load("won_reward"), load("run")


def play(env, secret: int, next_guess) -> bool:
    """One game: `next_guess(low, high)` picks each guess from what the hints allow so far."""
    env.reset(secret=secret)
    low, high = 1, 15
    for _ in range(game.MAX_GUESSES):
        n = next_guess(low, high)
        answer = env.guess(n)
        if answer == "correct":
            break
        low, high = (n + 1, high) if answer == "higher" else (low, n - 1)
    return env.won


def test_binary_search_wins_every_secret_in_four_guesses():
    # 15 = 2^4 - 1: the middle of what is left (8, then 4 or 12, ...) finds any secret by the 4th guess
    assert all(play(game.GuessNumber(), s, lambda lo, hi: (lo + hi) // 2) for s in range(1, 16))


def test_a_policy_that_ignores_the_feedback_wins_at_most_four_of_fifteen():
    # a fixed sequence of 4 guesses wins exactly the secrets it names: 4 distinct ones -> 4/15 = 0.267
    best = 0
    for picks in itertools.combinations(range(1, 16), 4):
        env, wins = game.GuessNumber(), 0
        for secret in range(1, 16):
            env.reset(secret=secret)
            for n in picks:
                env.guess(n)
            wins += env.won
        best = max(best, wins)
    assert best == 4


def test_the_rules_four_guesses_count_and_the_feedback_of_each_game():
    env = game.GuessNumber()
    env.reset(secret=9)
    assert [env.guess(n) for n in (3, 12, 1, 2)] == ["higher", "lower", "higher", "higher"]
    assert env.guess(9) == "the game is over" and not env.won  # a 5th guess does not count
    env.reset(secret=9)  # reset clears the last game
    assert env.guess(9) == "correct" and env.won and env.guesses == [9]
    assert env.guess(9) == "the game is over"
    silent, swapped = game.Uninformative(), game.Swapped()
    for e in (silent, swapped):
        e.reset(secret=9)
    assert [silent.guess(n) for n in (3, 12, 9)] == ["wrong", "wrong", "correct"]
    assert [swapped.guess(n) for n in (3, 12, 9)] == ["lower", "higher", "correct"]
    lost = game.GuessNumber()
    lost.reset(secret=2)
    lost.guess(3)
    # the reward reads each episode's instance: won or not, whatever the text says
    assert reward.won([""] * 4, ["correct"] * 4, environments=[silent, swapped, env, lost]) == [1.0, 1.0, 1.0, 0.0]


def test_reset_writes_the_demonstrated_game_and_then_the_question():
    env = game.GuessNumber()
    turns = env.reset(secret=4)
    assert [m["role"] for m in turns] == ["user", "assistant", "tool", "assistant", "user"]
    assert turns[-1]["content"].startswith("I am thinking of a whole number from 1 to 15.")
    low, high, secret, _ = game.DEMO_GAMES[0]
    assert turns[0]["content"].startswith(f"I am thinking of a whole number from {low} to {high}.")
    # the demonstrated call is read as an episode reads the model's calls, names the tool, and wins its own game
    [call] = ToolFormat("chatml", CHATML_TOOLS_TEMPLATE).parse(turns[1]["content"])
    assert call.error is None and call.name == "guess" and call.arguments == {"n": secret}
    demo = game.GuessNumber()
    demo.reset(secret=secret)
    assert demo.guess(**call.arguments) == turns[2]["content"] == "correct"
    # no strategy shown: every demonstrated game is won at once, by a number that is not its range's middle, on a
    # range apart from the real one
    assert all(s != (lo + hi) // 2 and lo > 15 for lo, hi, s, _ in game.DEMO_GAMES)
    assert [m["role"] for m in game.GuessNumber().reset(secret=1, top=7, demos=2)].count("tool") == 2


def test_demonstrated_misses_are_answered_only_wrong_and_follow_no_hint():
    turns = game.GuessNumber().reset(secret=4, demos=2, misses=2)
    # per game: its question, 2 missed calls answered "wrong", the hit, the reply; then the real question
    assert [m["role"] for m in turns] == ["user", *["assistant", "tool"] * 3, "assistant"] * 2 + ["user"]
    assert [m["content"] for m in turns if m["role"] == "tool"] == ["wrong", "wrong", "correct"] * 2
    # the demonstrated games say they answer only wrong or correct; the real one keeps its hints
    assert "it answers wrong or correct." in turns[0]["content"] and "higher" not in turns[0]["content"]
    assert "higher (my number is larger)" in turns[-1]["content"]
    fmt = ToolFormat("chatml", CHATML_TOOLS_TEMPLATE)
    for (low, high, secret, wrong), start in zip(game.DEMO_GAMES, (0, 8)):
        calls = [fmt.parse(turns[start + k]["content"])[0].arguments["n"] for k in (1, 3, 5)]
        assert calls == [*wrong, secret] and all(low <= n <= high for n in calls)
        demo = game.Uninformative()  # the demonstrated answers are the uninformative game's, true for its secret
        demo.reset(secret=secret)
        assert [demo.guess(n) for n in calls] == ["wrong", "wrong", "correct"]


def test_the_rows_load_as_data_env_every_secret_in_both_splits():
    task = build(compose("train", ["data=env", f"data.path={HERE / 'data'}"]).data)
    assert [e["secret"] for e in task.train] == [e["secret"] for e in task.heldout] == list(range(1, 16))


def guess_turn(*numbers: int) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}
                           for n in numbers]}


def tool(text: str) -> dict:
    return {"role": "tool", "name": "guess", "content": text}


def test_the_hinted_direction_share_counts_each_next_guess_after_a_hint():
    episode_a = [guess_turn(8), tool("higher"), guess_turn(12), tool("lower"), guess_turn(13), tool("correct")]
    # two calls in one turn pair with their two results in order; a turn whose calls did not all parse (one result
    # more than its calls) is left out, and so is a call whose result is an error (it did not run as a guess)
    episode_b = [guess_turn(5, 3), tool("lower"), tool("higher"), guess_turn(4), tool("error"), tool("lower"),
                 guess_turn(2), tool("lower"), guess_turn(6), tool("{'error': 'TypeError: ... argument m'}")]
    assert run.guesses(episode_a) == [(8, "higher"), (12, "lower"), (13, "correct")]
    assert run.guesses(episode_b) == [(5, "lower"), (3, "higher"), (2, "lower")]
    # a: 8 higher -> 12 (moved up: yes), 12 lower -> 13 (no); b: 5 lower -> 3 (yes), 3 higher -> 2 (no)
    assert run.hinted_moves([episode_a, episode_b]) == (2, 4)


def test_the_bootstrap_resamples_whole_games():
    # every game all won or all lost: a resample's rate is the share of won games drawn, so the interval is wider
    # than Wilson's over 120 independent plays would be for the same 0.5
    wins = {g: [g < 8] * 8 for g in range(16)}
    low, high = run.cluster_bootstrap(wins)
    wilson = run.wilson_interval(64, 128)
    assert low < wilson[0] and high > wilson[1] and low < 0.5 < high
    assert run.cluster_bootstrap({0: [True] * 8}) == (1.0, 1.0)


@pytest.mark.parametrize("top, demos, folder", [(15, 1, "data"), (7, 2, "runs_demos2_top7/data")])
def test_a_variant_writes_its_own_rows(tmp_path, top, demos, folder):
    args = type("Args", (), {"top": top, "demos": demos, "misses": 0, "out": tmp_path / "runs_demos2_top7"})()
    path = run.data_path(args)
    assert path == (HERE / "data" if folder == "data" else tmp_path / folder)
    if folder != "data":
        rows = build(compose("train", ["data=env", f"data.path={path}"]).data).heldout
        assert [(e["secret"], e["top"], e["demos"]) for e in rows] == [(s, 7, 2) for s in range(1, 8)]
