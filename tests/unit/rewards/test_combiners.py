"""The reward combiners: OutcomeReward (weighted sum) and ProcessReward (steps), and their robustness."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time

import pytest

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.rewards import OutcomeReward, ProcessReward, RewardResult
from grpo_cli.rewards.outcome import accuracy, format_reward, length_penalty
from grpo_cli.rewards.steps import step_rewards


def constant(*values):
    """A reward function that returns `values` whatever it is given."""
    return lambda prompts, completions, **_: list(values)


def test_public_api_imports():
    from grpo_cli.rewards import answers_match, extract_answer, split_steps, verify_steps  # noqa: F401


def test_weighted_sum_and_none():
    reward = OutcomeReward({"a": constant(1.0, 0.0, None), "b": constant(0.5, None, None)},
                           weights={"a": 2.0, "b": 1.0}, timeout_s=10.0, worker="process")
    result = reward(["p"] * 3, ["x", "y", "z"], {})
    # 2*1 + 1*0.5 = 2.5; 2*0 + (b gave None) = 0.0; nobody scored -> None
    assert result.rewards == [2.5, 0.0, None]
    assert result.per_function == {"a": [1.0, 0.0, None], "b": [0.5, None, None]}
    assert result.failures == 0 and result.steps is None


def test_missing_weight_is_one():
    reward = OutcomeReward({"a": constant(1.0), "b": constant(2.0)}, weights={"a": 3.0}, timeout_s=10.0,
                           worker="process")
    result = reward(["p"], ["x"], {})
    # 3*1 + 1*2 = 5
    assert result.rewards == [5.0]


def test_columns_reach_the_functions():
    seen = {}

    def spy(prompts, completions, answer, completion_length, **rest):
        seen.update(answer=answer, completion_length=completion_length, rest=sorted(rest))
        return [float(n) for n in completion_length]

    columns = {"answer": ["4", "5"], "completion_length": [3, 7], "truncated": [False, True], "source": ["a", "b"]}
    # in this process (its spy writes to `seen`)
    reward = OutcomeReward({"spy": spy, "accuracy": accuracy}, weights=None, timeout_s=10.0, worker="thread")
    result = reward(["p", "q"], ["#### 4", "#### 4"], columns)
    assert seen == {"answer": ["4", "5"], "completion_length": [3, 7], "rest": ["source", "truncated"]}
    # spy 3 + accuracy 1 = 4; spy 7 + accuracy 0 = 7
    assert result.rewards == [4.0, 7.0]


def test_raising_function_costs_only_its_completions(caplog):
    def picky(prompts, completions, **_):
        if any("bad" in c for c in completions):
            raise ValueError("cannot score 'bad'")
        return [1.0] * len(completions)

    reward = OutcomeReward({"picky": picky, "other": constant(0.5, 0.5, 0.5)}, weights=None, timeout_s=10.0,
                           worker="process")
    with caplog.at_level(logging.WARNING, logger="grpo_cli.rewards"):
        result = reward(["p"] * 3, ["good", "bad", "good"], {})
        reward(["p"] * 3, ["good", "bad", "good"], {})
    # the batch call raised; retried one by one, only "bad" loses picky's score (0.5 from other remains)
    assert result.per_function["picky"] == [1.0, None, 1.0]
    assert result.rewards == [1.5, 0.5, 1.5]
    assert result.failures == 1
    # warned once per function, not once per call
    assert sum("picky" in r.getMessage() for r in caplog.records) == 1


def test_always_raising_function():
    def broken(prompts, completions, **_):
        raise RuntimeError("boom")

    reward = OutcomeReward({"broken": broken}, weights=None, timeout_s=10.0, worker="process")
    result = reward(["p", "p"], ["x", "y"], {})
    assert result.rewards == [None, None] and result.failures == 1


def test_slow_function_in_a_thread_times_out_and_the_run_continues():
    release = threading.Event()

    def slow(prompts, completions, **_):
        release.wait(5)
        return [1.0] * len(completions)

    reward = OutcomeReward({"slow": slow, "fast": constant(0.25, 0.25)}, weights=None, timeout_s=0.05, worker="thread")
    try:
        start = time.perf_counter()
        first = reward(["p", "p"], ["x", "y"], {})
        # still running from the first call: skipped at once, not queued behind it
        second = reward(["p", "p"], ["x", "y"], {})
        elapsed = time.perf_counter() - start
    finally:
        release.set()
    assert first.per_function["slow"] == [None, None] and first.rewards == [0.25, 0.25]
    assert first.failures == 1 and second.failures == 1
    assert elapsed < 1.0


def test_a_hung_call_in_a_worker_process_costs_that_call_only(tmp_path):
    first_call = tmp_path / "first_call"

    def hangs_once(prompts, completions, **_):
        if not first_call.exists():
            first_call.touch()
            while True:  # holds the CPU until its worker is killed
                pass
        return [1.0] * len(completions)

    reward = OutcomeReward({"hangs": hangs_once}, weights=None, timeout_s=0.5, worker="process")
    assert reward(["p"], ["x"], {}).rewards == [None]
    start = time.perf_counter()
    second = reward(["p"], ["x"], {})
    # a new worker answers at once; a thread would still be looping, and the call skipped
    assert second.rewards == [1.0] and second.failures == 0 and time.perf_counter() - start < 0.5


def test_malformed_output_is_a_failure():
    nan = OutcomeReward({"nan": constant(math.nan, 1.0)}, weights=None, timeout_s=10.0,
                        worker="process")(["p", "p"], ["x", "y"], {})
    # NaN is no score, not a failure
    assert nan.rewards == [None, 1.0] and nan.failures == 0
    short = OutcomeReward({"short": constant(1.0)}, weights=None, timeout_s=10.0,
                          worker="process")(["p", "p"], ["x", "y"], {})
    # one score for two completions: the batch call fails; one by one, each single call returns 1.0
    assert short.failures == 1 and short.rewards == [1.0, 1.0]
    text = OutcomeReward({"text": constant("high", "low")}, weights=None, timeout_s=10.0,
                         worker="process")(["p", "p"], ["x", "y"], {})
    assert text.rewards == [None, None] and text.failures == 1


def test_inline_without_timeout():
    # timeout_s null: called on this thread, so math-verify may use its own signal timeouts
    reward = OutcomeReward({"accuracy": accuracy}, weights=None, timeout_s=None, worker="process")
    result = reward(["p"], ["\\boxed{\\sqrt{4}}"], {"answer": ["2"]})
    assert result.rewards == [1.0]


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_math_verify_in_a_worker(worker):
    # in a thread signal.alarm is unavailable (grpo's accuracy turns math-verify's timeout off there)
    reward = OutcomeReward({"accuracy": accuracy}, weights=None, timeout_s=10.0, worker=worker)
    result = reward(["p"], ["\\boxed{\\sqrt{4}}"], {"answer": ["2"]})
    assert result.rewards == [1.0] and result.failures == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"functions": {}}, "reward.functions is empty"),
    ({"functions": {"a": "not callable"}}, "reward.functions.a is not callable"),
    ({"functions": {"a": constant(1.0)}, "weights": {"b": 1.0}}, "reward.weights.b has no function"),
])
def test_outcome_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        OutcomeReward(**{"weights": None, "timeout_s": 10.0, "worker": "process", **kwargs})


def test_config_error_inside_a_function_stops_the_run():
    # a bad option fails on every call: the user gets the fix, not a run with no rewards
    reward = OutcomeReward({"length": functools.partial(length_penalty, max_length=10, buffer=0)}, weights=None,
                           timeout_s=10.0, worker="process")
    with pytest.raises(ConfigError, match="buffer"):
        reward(["p"], ["x"], {"completion_length": [3]})


def test_misspelt_option_is_caught():
    # format_reward takes **_ (unknown columns), which would swallow a typo such as `mach`
    with pytest.raises(ConfigError, match="reward.functions.format.mach is not a parameter of format_reward"):
        OutcomeReward({"format": functools.partial(format_reward, mach=1.0)}, weights=None, timeout_s=10.0,
                      worker="process")
    with pytest.raises(ConfigError, match="reward.scorer.corect is not a parameter"):
        ProcessReward(functools.partial(step_rewards, corect=1.0), outcome=None, timeout_s=10.0,
                      process_weight=None, worker="process", credit="sum")


def test_process_reward_sums_steps():
    reward = ProcessReward(step_rewards, outcome={"accuracy": accuracy}, timeout_s=10.0, process_weight=None,
                           worker="process", credit="sum")
    completions = ["2 + 2 = 4\n#### 4", "2 + 2 = 5\nso\n#### 5", ""]
    result = reward(["p"] * 3, completions, {"answer": ["4", "4", "4"]})
    assert isinstance(result, RewardResult)
    # 1: right (+1), then the answer's step with the completion (16 chars -> 17; outcome +1): sum 2, mean 1
    # 2: wrong (-1); "so" and "#### 5" make no claim (no step); the answer's step -1 at 19 + 1 -> sum -2, mean -1
    # 3: blank -> no steps, no score
    assert result.steps == [[(9, 1.0), (17, 1.0)], [(9, -1.0), (20, -1.0)], []]
    assert result.rewards == [2.0, -2.0, None]
    assert result.per_function["steps"] == [1.0, -1.0, None]
    assert result.per_function["accuracy"] == [1.0, 0.0, 0.0]
    assert result.failures == 0


def test_process_reward_scorer_failures():
    def outside(prompts, completions, **_):
        return [[(len(c) + 5, 1.0)] for c in completions]  # char_end past the text: a scorer bug

    def broken(prompts, completions, **_):
        raise RuntimeError("boom")

    for scorer in (outside, broken):
        result = ProcessReward(scorer, outcome=None, timeout_s=10.0, process_weight=None, worker="process",
                               credit="sum")(["p"], ["abc"], {})
        assert result.steps == [[]] and result.rewards == [None] and result.failures == 1


def test_process_reward_sorts_steps():
    reward = ProcessReward(lambda prompts, completions, **_: [[(3, 0.5), (1, 0.25)]], outcome=None, timeout_s=10.0,
                           process_weight=None, worker="process", credit="sum")
    result = reward(["p"], ["abc"], {})
    assert result.steps == [[(1, 0.25), (3, 0.5)]] and result.rewards == [0.75]


def test_process_config_errors():
    with pytest.raises(ConfigError, match="reward.scorer is not callable"):
        ProcessReward("step_rewards", outcome=None, timeout_s=10.0, process_weight=None, worker="process",
                      credit="sum")
    with pytest.raises(ConfigError, match="reward.outcome.steps"):
        ProcessReward(step_rewards, outcome={"steps": accuracy}, timeout_s=10.0, process_weight=None,
                      worker="process", credit="sum")


def test_combiners_name_their_scores_and_the_columns_they_need():
    # accuracy(prompts, completions, answer, ...) cannot score without `answer`; format_reward needs nothing;
    # step_rewards takes `answer` with a default (None: no answer step), so it needs nothing either
    outcome = OutcomeReward({"accuracy": accuracy, "format": format_reward}, weights=None, timeout_s=10.0,
                            worker="process")
    assert outcome.names() == ["accuracy", "format"]
    assert outcome.needs() == {"accuracy": ["answer"], "format": []}
    process = ProcessReward(step_rewards, outcome={"accuracy": accuracy}, timeout_s=10.0, process_weight=None,
                            worker="process", credit="sum")
    assert process.names() == ["steps", "accuracy"]  # `steps`: each completion's mean step reward
    assert process.needs() == {"scorer": [], "accuracy": ["answer"]}
    assert ProcessReward(step_rewards, outcome=None, timeout_s=10.0, process_weight=None, worker="process",
                         credit="sum").names() == ["steps"]


@pytest.mark.parametrize("overrides", [["reward.weights.accuracy=nan"],
                                       ["reward=custom", "reward.funcs=[accuracy]", "reward.weights=[inf]"]])
def test_reward_weights_must_be_finite(overrides):
    # one NaN weight makes every summed reward NaN: a run that trains on nothing
    with pytest.raises(ConfigError, match=r"^reward.weights \(.*\) must hold finite numbers.*; set reward.weights"):
        validate(compose("train", overrides))


def test_per_turn_scores_for_completions_that_are_no_episodes_are_no_score():
    # a list is one score per assistant turn of an episode; plain completions have none: the function failed
    functions = {"turns": lambda p, c, **_: [[1.0, 0.0] for _ in c], "one": lambda p, c, **_: [1.0] * len(c)}
    reward = OutcomeReward(functions, None, None, worker="thread")
    result = reward(["q", "q"], ["a", "b"], {})
    assert result.turns is None and result.failures == 1
    assert result.rewards == [1.0, 1.0] and result.per_function["turns"] == [None, None]
