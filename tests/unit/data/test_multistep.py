"""The multi-step arithmetic task (grpo_cli.data.MultiStepTask), the step verifier on its solutions, and
the two recipes of the process-vs-outcome experiment."""

from __future__ import annotations

import random
import re

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_cli.config import compose, validate
from grpo_cli.data import MultiStepTask, _Problem, load_task
from grpo_cli.errors import ConfigError
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards import chain_steps, extract_answer, verify_steps

LINE = re.compile(r"^(-?\d+) ([-+*]) (\d+) = (-?\d+)$")


def running_totals(example) -> list[int]:
    return [int(LINE.match(line).group(4)) for line in example["solution"].split("\n")]


# ---- the problems -----------------------------------------------------------------------------

def test_hand_worked_problems():
    task = load_task("multistep")
    rng = random.Random(0)
    question, answer, solution = task._make(_Problem((23, 14, 9, 31), ("+", "-", "+")), rng)
    # left to right: 23 + 14 = 37, 37 - 9 = 28, 28 + 31 = 59
    assert question == "Compute 23 + 14 - 9 + 31."
    assert (answer, solution) == ("59", "23 + 14 = 37\n37 - 9 = 28\n28 + 31 = 59")
    # * first: 4 * 5 = 20, then 3 + 20 = 23, 23 - 6 = 17
    made = task._make(_Problem((3, 4, 5, 6), ("+", "*", "-")), rng)
    assert made[1:] == ("17", "4 * 5 = 20\n3 + 20 = 23\n23 - 6 = 17")
    # the prompt: data.few_shot solved problems as earlier turns, then the question inside the instruction
    example = task.train[0]
    assert [m["role"] for m in example["messages"]] == ["user", "assistant"] * task.few_shot + ["user"]
    assert example["messages"][-1]["content"] == task.instruction.replace("{question}", example["question"])
    assert set(example) == {"messages", "question", "answer", "solution"}


def test_deterministic_per_seed():
    a, b, c = load_task("multistep", seed=5), load_task("multistep", seed=5), load_task("multistep", seed=6)
    assert [a.train[i] for i in range(100)] == [b.train[i] for i in range(100)]
    assert a.heldout == b.heldout and a.shots == b.shots
    assert [a.train[i]["question"] for i in range(100)] != [c.train[i]["question"] for i in range(100)]
    assert [e["question"] for e in a.heldout] != [e["question"] for e in c.heldout]
    # item i is a pure function of (seed, i): read alone, out of order, it is the same
    assert load_task("multistep", seed=5).train[4321] == a.train[4321]


def test_heldout_and_few_shot_never_in_train():
    # a space small enough that an unguarded stream would hit held-out problems all the time:
    # 9^3 = 729 sums of three digits; 300 held out + 3 shots leave 426 for training
    task = load_task("multistep", num_operands=3, operators=["+"], heldout_size=300, few_shot=3)
    held = {e["question"] for e in task.heldout}
    shots = {q for q, _ in task.shots}
    assert len(held) == 300 and len(shots) == 3 and not held & shots
    seen = {task.train[i]["question"] for i in range(4000)}
    assert not seen & (held | shots)
    # the stream did cover the space (so the check above had chances to fail): almost all 426 seen
    assert len(seen) > 400
    # the default task too
    task = load_task("multistep")
    held = {e["question"] for e in task.heldout} | {q for q, _ in task.shots}
    assert not held & {task.train[i]["question"] for i in range(3000)}


@pytest.mark.parametrize("overrides", [
    {},
    {"num_operands": 5, "max_digits": 2, "operators": ["+", "-", "*"], "nonnegative": False},
    {"num_operands": 2, "min_digits": 2, "max_digits": 3, "operators": ["*"]},
], ids=["default", "five-operands-with-star", "one-step"])
def test_knobs(overrides):
    task = load_task("multistep", **overrides)
    config = OmegaConf.merge(OmegaConf.load(CONF_DIR / "data" / "multistep.yaml"), overrides)
    for example in [task.train[i] for i in range(300)] + task.heldout[:100]:
        expr = re.fullmatch(r"Compute ([-+* \d]+)\.", example["question"]).group(1)
        numbers = [int(n) for n in re.findall(r"\d+", expr)]
        assert len(numbers) == config.num_operands
        assert all(config.min_digits <= len(str(n)) <= config.max_digits for n in numbers)
        assert set(re.findall(r"[-+*]", expr)) <= set(config.operators)
        # one line per operation; Python's precedence is the one the lines follow
        assert len(example["solution"].split("\n")) == config.num_operands - 1
        assert int(example["answer"]) == eval(expr) == running_totals(example)[-1]


def test_nonnegative_redraws_negative_running_totals():
    kept = load_task("multistep", operators=["-", "+"], max_digits=2)
    assert all(min(running_totals(kept.train[i])) >= 0 for i in range(500))
    # without it about 45% of these problems dip below zero somewhere (the knob is not a no-op)
    free = load_task("multistep", operators=["-", "+"], max_digits=2, nonnegative=False)
    dips = sum(min(running_totals(free.train[i])) < 0 for i in range(500))
    assert 150 < dips < 350


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"data.nonnegative \('yes'\) must be true or false; set data.nonn"):
        load_task("multistep", nonnegative="yes")
    with pytest.raises(ConfigError, match=r"data.num_operands \(1\) must be an integer >= 2"):
        load_task("multistep", num_operands=1)
    # only subtraction of a larger number: every draw goes negative
    with pytest.raises(ConfigError, match=r"negative running total; set data.nonnegative=false"):
        load_task("multistep", operators=["-"], min_digits=2, max_digits=2, num_operands=12, heldout_size=1)


def test_task_class_is_an_arithmetic_task():
    # the test that builds every conf/data/*.yaml checks it gets one of the known task classes
    from grpo_cli.data import ArithmeticTask

    assert issubclass(MultiStepTask, ArithmeticTask)


# ---- the step verifier on the task's solutions ------------------------------------------------

def test_hand_worked_solution_verifies():
    solution = "23 + 14 = 37\n37 - 9 = 28\n28 + 31 = 59"
    # lines end at 12, 12 + 1 + 11 = 24 and 24 + 1 + 12 = 37; each holds (+1); the answer (59, right) is a step
    # of its own that ends with the completion (37 + 1 = 38, its EOS): +1
    assert verify_steps(solution, "59") == [(12, 1.0), (24, 1.0), (37, 1.0), (38, 1.0)]
    # 37 - 9 is 28, not 29: that line -1; the next line still holds and the answer is still 59
    assert verify_steps(solution.replace("= 28", "= 29"), "59") == [(12, 1.0), (24, -1.0), (37, 1.0), (38, 1.0)]
    # 28 + 31 is 59, not 58: the line -1, and the answer (58) is wrong, -1
    assert verify_steps(solution.replace("= 59", "= 58"), "59") == [(12, 1.0), (24, 1.0), (37, -1.0), (38, -1.0)]


@pytest.mark.parametrize("overrides", [
    {}, {"num_operands": 5, "max_digits": 3, "operators": ["+", "-", "*"], "nonnegative": False},
], ids=["default", "five-operands-with-star-and-negatives"])
def test_every_reference_line_correct_and_every_perturbed_line_wrong(overrides):
    task = load_task("multistep", **overrides)
    steps = task.num_operands - 1
    for example in [task.train[i] for i in range(200)] + task.heldout[:100] + [
            {"solution": s, "answer": s.rsplit(" ", 1)[1]} for _, s in task.shots]:
        solution, answer = example["solution"], example["answer"]
        assert extract_answer(solution) == answer
        # every line holds (+1), and the answer's step is right (+1)
        assert [r for _, r in verify_steps(solution, answer)] == [1.0] * steps + [1.0]
        assert [r for _, r in chain_steps(solution, solution, answer)] == [1.0] * steps + [1.0]
        lines = solution.split("\n")
        for k, line in enumerate(lines):
            a, op, b, c = LINE.match(line).groups()
            wrong = lines[:k] + [f"{a} {op} {b} = {int(c) + 1}"] + lines[k + 1:]
            rewards = [r for _, r in verify_steps("\n".join(wrong), answer)]
            # line k is wrong (-1); a wrong last line also makes the answer's step wrong (-1)
            expected = [1.0] * steps + [1.0]
            expected[k] = -1.0
            if k == steps - 1:
                expected[-1] = -1.0
            assert rewards == expected, (solution, k)
            # the chain judge agrees: only the changed line is off the reference
            assert [r for _, r in chain_steps("\n".join(wrong), solution, answer)] == expected, (solution, k)


# ---- the experiment's recipes -----------------------------------------------------------------

def test_recipes_differ_in_the_reward_alone():
    outcome = OmegaConf.to_container(compose("train", ["+recipe=multistep_outcome"]))
    process = OmegaConf.to_container(compose("train", ["+recipe=multistep_process"]))
    assert outcome.pop("reward")["_target_"] == "grpo_cli.rewards.OutcomeReward"
    assert process.pop("reward")["_target_"] == "grpo_cli.rewards.ProcessReward"
    assert outcome == process
    assert outcome["data"]["_target_"] == "grpo_cli.data.MultiStepTask"
    # the same seeded runs: a sweep over trainer.seed changes both arms alike
    outcome = compose("train", ["+recipe=multistep_outcome", "trainer.seed=2"])
    process = compose("train", ["+recipe=multistep_process", "trainer.seed=2"])
    assert outcome.trainer == process.trainer and outcome.trainer.seed == 2
    validate(outcome), validate(process)


def test_process_reward_scores_a_reference_and_a_slip():
    reward = instantiate(OmegaConf.load(CONF_DIR / "reward" / "multistep_process.yaml"))
    completions = ["3 + 9 = 12\n12 - 3 = 9\n9 - 1 = 8",      # the reference of 3 + 9 - 3 - 1
                   "3 + 9 = 12\n12 - 3 = 8\n8 - 1 = 7",       # a slip in line 2, then true arithmetic
                   "The answer is 8.",                        # no claim, right answer
                   "3 + 1 = 4"]                               # true, but not a step of this problem
    solutions = ["3 + 9 = 12\n12 - 3 = 9\n9 - 1 = 8"] * 4
    result = reward(["Compute 3 + 9 - 3 - 1."] * 4, completions, {"answer": ["8"] * 4, "solution": solutions})
    # lines end at 10, 10 + 1 + 10 = 21, 21 + 1 + 9 = 31; the 3 slots, then the answer's step with the completion
    # (31 + 1 = 32; the prose is 16 characters -> 17, the gamed line 9 -> 10); unwritten slots end where the chain
    # stopped, on the last claim line's last character (the gamed line's 9), or with the completion without one
    # reference: +1, +1, +1, answer +1 -> sum 4
    # slip: +1, -1 (12 - 3 is 9); 8 - 1 = 7 holds but is not the reference's third step (9 - 1 = 8): -1;
    # the answer 7 is wrong: -1 -> sum -2
    # prose: no claim, no line step; the 3 slots never written -1 each, the answer 8 right +1 -> sum -2
    # the gamed line (what step_rewards paid +1 for): off the chain -1, slots 2 and 3 never written -1 each, the
    # answer 4 wrong -1 -> sum -4
    assert result.steps == [[(10, 1.0), (21, 1.0), (31, 1.0), (32, 1.0)],
                            [(10, 1.0), (21, -1.0), (31, -1.0), (32, -1.0)],
                            [(17, -1.0), (17, -1.0), (17, -1.0), (17, 1.0)],
                            [(9, -1.0), (9, -1.0), (9, -1.0), (10, -1.0)]]
    assert result.rewards == [4.0, -2.0, -2.0, -4.0]
    # the metric both recipes log, rewards/accuracy/mean
    assert result.per_function["accuracy"] == [1.0, 0.0, 1.0, 0.0]


def test_chain_steps_needs_the_reference_step_in_order():
    solution = "6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4"
    # the first step alone, then stop: slot 1 +1 (at its last character, 9), slots 2 and 3 never written -1 each
    # where the chain stopped (9 too), and the answer 3 wrong -1 with the completion (10, its EOS)
    assert chain_steps("6 - 3 = 3", solution, "4") == [(9, 1.0), (9, -1.0), (9, -1.0), (10, -1.0)]
    # missing=0 makes stopping early free again (the option the recipe does not take)
    assert chain_steps("6 - 3 = 3", solution, "4", missing=0.0) == [(9, 1.0), (9, 0.0), (9, 0.0), (10, -1.0)]
    # trying on and slipping on the second: +1, -1, -1 (off the chain after the slip), answer 5 wrong -1
    assert [r for _, r in chain_steps("6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5", solution, "4")] == [1.0, -1.0, -1.0, -1.0]
    # all three steps written: nothing missing
    assert [r for _, r in chain_steps(solution, solution, "4")] == [1.0, 1.0, 1.0, 1.0]
    # the right steps in the wrong order: line 1 is not step 1, line 2 is not step 2 (each -1), slot 3 missing -1,
    # answer 3 wrong -1
    assert [r for _, r in chain_steps("3 + 8 = 11\n6 - 3 = 3", solution, "4")] == [-1.0, -1.0, -1.0, -1.0]
    # spacing and a trailing period do not matter; a closing line with no claim is no step (the answer's step ends
    # with the completion: "6-3=3." ends at 6, "3 +8 = 11" at 16, "11 - 7 = 4." at 28, the text at 48 -> 49)
    assert chain_steps("6-3=3.\n3 +8 = 11\n11 - 7 = 4.\nSo the answer is 4.", solution, "4") == [
        (6, 1.0), (16, 1.0), (28, 1.0), (49, 1.0)]
    # a true claim past the last reference step is an extra step: -1 (then the answer, +1)
    assert [r for _, r in chain_steps(solution + "\n4 + 0 = 4", solution, "4")] == [1.0, 1.0, 1.0, -1.0, 1.0]
    # a right step with a wrong extra claim on the same line is wrong (no answer given: no answer step)
    assert [r for _, r in chain_steps("6 - 3 = 3 = 4", solution)] == [-1.0, -1.0, -1.0]
    # truncated: the answer's step scores outcome_truncated (-2) even though the text's last number is the answer
    assert chain_steps(solution, solution, "4", truncated=True)[-1] == (len(solution) + 1, -2.0)


def test_outcome_reward_scores_the_answer_alone():
    cfg = compose("train", ["+recipe=multistep_outcome"])
    reward = instantiate(cfg.reward)
    completions = ["3 + 9 = 12\n12 - 3 = 9\n9 - 1 = 8", "3 + 9 = 12\n12 - 3 = 8\n8 - 1 = 7", "The answer is 8."]
    # 1 when the last number is 8: the slip scores like any wrong answer, the prose like the reference
    assert reward(["q"] * 3, completions, {"answer": ["8"] * 3}).rewards == [1.0, 0.0, 1.0]



def test_the_final_step_ends_at_eos_so_stopping_gets_its_advantage():
    """Process advantages: the last step's reward sits on the completion's last token (its EOS), so the
    choice to stop carries the final step's advantage (at the last character, EOS got 0 and the policy
    learned to stop after one line)."""
    import torch

    from grpo_cli.credit import advantages, token_rewards
    from grpo_cli.policy import char_tokenizer
    from grpo_cli.rewards import RewardResult
    from grpo_cli.rollout import Rollout

    tok = char_tokenizer()
    eos = tok.eos_token_id
    # two completions of one group: "ab\ncd" + EOS (steps end at chars 2 and 5) and "ab" + EOS (one step)
    rows = [tok.encode("ab\ncd", add_special_tokens=False) + [eos], tok.encode("ab", add_special_tokens=False) + [eos]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])  # [2, 6], pad = eos
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    rollout = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), ids, mask,
                      ["ab\ncd", "ab"], [False, False])
    result = RewardResult(rewards=[0.0, -2.0], per_function={}, steps=[[(2, 1.0), (5, -1.0)], [(2, -2.0)]])
    adv = advantages(token_rewards(result, rollout, tok), 2, "group", "population")
    # step rewards 1, -1, -2: mean -2/3, population std sqrt(((5/3)^2 + (1/3)^2 + (4/3)^2) / 3) = sqrt(14)/3
    sd = 14 ** 0.5 / 3
    n1, n2, n3 = (1 + 2 / 3) / sd, (-1 + 2 / 3) / sd, (-2 + 2 / 3) / sd
    # row 0: tokens a b (step 1 ends at b) get n1 + n2; \n c d and EOS (step 2 ends at EOS) get n2
    assert adv[0].tolist() == pytest.approx([n1 + n2, n1 + n2, n2, n2, n2, n2], abs=1e-3)
    # row 1: "ab" then EOS: the stop itself carries the step's n3 (it was 0 before)
    assert adv[1].tolist() == pytest.approx([n3, n3, n3, 0.0, 0.0, 0.0], abs=1e-3)
