"""Procedural tasks: seeded arithmetic problems (ArithmeticTask) and their multi-step chains (MultiStepTask)."""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import NamedTuple

from grpo_cli.data.task import Example, _check_int, _Generated, _Task
from grpo_cli.errors import ConfigError

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_STYLES = ("bare", "expression", "word")
# a train draw whose problem is held out is redrawn; validation keeps the odds of that <= 1/2,
# so running out of tries means a bug or a pathological setting, not bad luck
_MAX_TRIES = 1000

_NAMES = ("Sam", "Ava", "Leo", "Mia", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Iris")
_ITEMS = ("apples", "marbles", "stickers", "coins", "shells", "pencils", "cards", "books")
_WORD_STEPS = {
    "+": ("{name} buys {n} more {item}.", "{name} finds {n} more {item}.",
          "A friend gives {name} {n} more {item}."),
    "-": ("{name} gives away {n} {item}.", "{name} loses {n} {item}.", "{name} sells {n} {item}."),
    "*": ("Then the number of {item} {name} has becomes {n} times as large.",
          "Then {name}'s pile of {item} grows to {n} times its size."),
}


def solve(operands: Sequence[int], operators: Sequence[str], precedence: bool = True) -> tuple[int, list[str]]:
    """(result, step lines "a op b = c") of an integer expression.

    precedence=True folds each run of `*` first, then applies + and - left to right (how
    `34 + 57 * 2` reads); precedence=False applies every operator left to right (a story's order).
    """
    steps: list[str] = []

    def apply(a: int, op: str, b: int) -> int:
        result = _OPS[op](a, b)
        steps.append(f"{a} {op} {b} = {result}")
        return result

    nums, ops = list(operands), list(operators)
    if precedence:
        terms, term_ops = [nums[0]], []
        for op, b in zip(ops, nums[1:]):
            if op == "*":
                terms[-1] = apply(terms[-1], op, b)
            else:
                terms.append(b)
                term_ops.append(op)
        nums, ops = terms, term_ops
    total = nums[0]
    for op, b in zip(ops, nums[1:]):
        total = apply(total, op, b)
    return total, steps


class _Problem(NamedTuple):
    operands: tuple[int, ...]
    operators: tuple[str, ...]


class ArithmeticTask(_Task):
    """Procedural, verifiable arithmetic: seeded, lazily generated, held-out problems excluded.

    Operands: the digit count is drawn uniformly from [min_digits, max_digits], then the value
    uniformly among numbers with that many digits (so short numbers are not drowned out).
    Styles `bare` ("What is 34 + 57 * 2?") and `expression` ("34 + 57 * 2 = ?") follow standard
    precedence (* before + and -); `word` is a story told in order, so it is evaluated left to
    right, and a `-` step never takes away more than there is (the amount is redrawn below the
    running total). Answers are integers, possibly negative in the first two styles.
    """

    def __init__(self, *, num_operands: int, min_digits: int, max_digits: int, operators: Sequence[str],
                 style: str, seed: int, train_size: int, heldout_size: int, system_prompt: str | None,
                 instruction: str, few_shot: int,
                 chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        if heldout_size == "auto":  # a share of a stream of made-up problems would be a share of train_size
            raise ConfigError("data.heldout_size=auto is for data read from files (a share of its rows); a generated "
                              "task needs a number: set data.heldout_size=500")
        super().__init__(seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot,
                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        _check_int("num_operands", num_operands, 2, 2)
        _check_int("min_digits", min_digits, 1, 1)
        _check_int("max_digits", max_digits, min_digits, min_digits)
        _check_int("train_size", train_size, 1, 100000)
        if isinstance(operators, Sequence) and not isinstance(operators, str):
            operators = list(operators)  # a ListConfig when Hydra builds the task
        if not isinstance(operators, list) or not operators or any(op not in _OPS for op in operators):
            raise ConfigError(f"data.operators ({operators!r}) must be a non-empty list drawn from + - *; "
                              f"set data.operators='[+,-]'")
        if style not in _STYLES:
            raise ConfigError(f"data.style ({style!r}) must be one of {', '.join(_STYLES)}; set data.style=bare")
        values = 10 ** max_digits - 10 ** (min_digits - 1)
        distinct = values ** num_operands * len(set(operators)) ** (num_operands - 1)
        if 2 * (heldout_size + few_shot) > distinct:
            raise ConfigError(
                f"data.heldout_size ({heldout_size}) + data.few_shot ({few_shot}) must be at most half of the "
                f"{distinct} distinct problems these settings allow, so training problems stay plentiful; "
                f"lower data.heldout_size or raise data.max_digits / data.num_operands")
        self.num_operands = num_operands
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.operators = operators
        self.style = style
        self.train_size = train_size

        # held-out and few-shot problems come from their own seeded streams; train never draws them
        held = self._distinct(random.Random(f"{seed}-heldout"), heldout_size, set())
        shots = self._distinct(random.Random(f"{seed}-fewshot"), few_shot, {p for p, _ in held})
        self._reserved = {p for p, _ in held} | {p for p, _ in shots}
        self.shots = [(q, s) for _, (q, _a, s) in shots]
        self.heldout = [self._example(*made) for _, made in held]
        self.train = _Generated(train_size, self._train_example)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    def _draw(self, rng: random.Random) -> _Problem:
        nums = [self._operand(rng) for _ in range(self.num_operands)]
        ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
        if self.style == "word":
            total = nums[0]
            for j, op in enumerate(ops):
                if op == "-" and nums[j + 1] > total:
                    nums[j + 1] = rng.randint(min(1, total), total)
                total = _OPS[op](total, nums[j + 1])
        return _Problem(tuple(nums), tuple(ops))

    def _make(self, problem: _Problem, rng: random.Random) -> tuple[str, str, str]:
        """(question, answer, solution) of a problem; `rng` picks the word-problem wording."""
        nums, ops = problem
        result, steps = solve(nums, ops, precedence=self.style != "word")
        if self.style == "word":
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            story = [f"{name} has {nums[0]} {item}."]
            for op, n in zip(ops, nums[1:]):
                story.append(rng.choice(_WORD_STEPS[op]).format(name=name, n=n, item=item))
            question = " ".join(story + [f"How many {item} does {name} have now?"])
        else:
            expr = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
            question = f"What is {expr}?" if self.style == "bare" else f"{expr} = ?"
        return question, str(result), "\n".join(steps + [f"#### {result}"])

    def _distinct(self, rng: random.Random, count: int, exclude: set[_Problem]) -> list[tuple[_Problem, tuple]]:
        out: list[tuple[_Problem, tuple]] = []
        seen = set(exclude)
        for _ in range(_MAX_TRIES * (count + 1)):
            if len(out) == count:
                return out
            problem = self._draw(rng)
            if problem not in seen:
                seen.add(problem)
                out.append((problem, self._make(problem, rng)))
        raise ConfigError(f"could not draw {count} distinct held-out/few-shot problems with these settings; "
                          f"lower data.heldout_size or raise data.max_digits")

    def _train_example(self, i: int) -> Example:
        # a fresh generator per (index, try): example i costs O(1) and never depends on others
        for attempt in range(_MAX_TRIES):
            rng = random.Random(f"{self.seed}-train-{i}-{attempt}")
            problem = self._draw(rng)
            if problem not in self._reserved:
                return self._example(*self._make(problem, rng))
        raise ConfigError(f"train example {i}: every draw was a held-out problem; "
                          f"lower data.heldout_size or raise data.max_digits")



class MultiStepTask(ArithmeticTask):
    """Arithmetic chains solved one operation per line, for process supervision.

    "Compute 23 + 14 - 9 + 31." has the reference solution `23 + 14 = 37`, `37 - 9 = 28`,
    `28 + 31 = 59`: one `a op b = c` line per operation (`solve`'s steps, * before + and -), each a
    claim the rule-based step verifier (`grpo_cli.rewards.steps`) checks, and the last line's result
    is the answer. ArithmeticTask's machinery draws the problems (operands, seeded streams, the
    held-out and few-shot problems never drawn for train); what differs: the solution has no
    `#### N` line (it would be a step the verifier cannot check), and with `nonnegative` a problem
    whose running total dips below zero is redrawn whole, so the kept problems are uniform over
    the non-negative ones (about 55% of three-operation +/- problems with 1-2 digit operands).
    """

    def __init__(self, *, num_operands: int, min_digits: int, max_digits: int, operators: Sequence[str],
                 nonnegative: bool, seed: int, train_size: int, heldout_size: int, system_prompt: str | None,
                 instruction: str, few_shot: int,
                 chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        if not isinstance(nonnegative, bool):
            raise ConfigError(f"data.nonnegative ({nonnegative!r}) must be true or false; set data.nonnegative=true")
        # read by _draw, which the parent's constructor already calls
        self.nonnegative = nonnegative
        super().__init__(num_operands=num_operands, min_digits=min_digits, max_digits=max_digits,
                         operators=operators, style="bare", seed=seed, train_size=train_size,
                         heldout_size=heldout_size, system_prompt=system_prompt, instruction=instruction,
                         few_shot=few_shot, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)

    def _draw(self, rng: random.Random) -> _Problem:
        for _ in range(_MAX_TRIES):
            problem = super()._draw(rng)
            _, steps = solve(problem.operands, problem.operators)
            if not self.nonnegative or all(int(line.rsplit(" ", 1)[1]) >= 0 for line in steps):
                return problem
        raise ConfigError("every drawn problem had a negative running total; set data.nonnegative=false "
                          "or add + to data.operators")

    def _make(self, problem: _Problem, rng: random.Random) -> tuple[str, str, str]:
        nums, ops = problem
        result, steps = solve(nums, ops)
        expr = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
        return f"Compute {expr}.", str(result), "\n".join(steps)
