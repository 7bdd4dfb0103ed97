"""Reasoning steps: split a completion into steps and score each step by checking its arithmetic.

DeepSeekMath's process supervision (arXiv 2402.03300, §4.1.3) rewards each step with a learned
process reward model (PRM). This module is the rule-based stand-in: a step is a line that makes an
arithmetic claim, `expr = value` in the text or GSM8K calculator notes `<<expr=value>>`. All claims
right -> `correct` (+1), any claim wrong -> `wrong` (-1). When the example's `answer` is given, the
final answer is one more step at the end of the text: `outcome_correct` (+1) or `outcome_wrong` (-1),
and a truncated completion's answer scores `outcome_truncated` (-2, `wrong_if_truncated`). A learned PRM
lives in `grpo_cli.rewards.models`.

Where this departs from scoring every line, and why. The trainer normalizes all step rewards of a
group by their mean μ and std σ and gives each token the sum of the normalized rewards of the steps
ending at or after it, so the first token's advantage is (Σ r_k - μ·N)/σ with N the completion's step
count: when μ < 0 every extra step is worth |μ|/σ. A claim-free line ("So the answer is 5.", "Let me
check.", a line cut off mid-claim) scored 0 was such a step: padding turned a wrong answer into a
rewarded one (issue #27). So a line without a claim is not a step at all (no reward, not counted in
μ, σ or the sum), and the answer is its own step rather than added to the last line's reward (which
spanned -5..+2 and inflated σ).

Arithmetic that holds is not a step that helps: on `data=multistep` a policy trained with
`step_rewards` learned to write one true line that has nothing to do with the problem ("6 + 3 = 9"
for "6 - 3 + 8 - 7") and stop (README, Process vs outcome). Where the example has a reference
`solution` of one `a op b = c` line per step, `chain_step_rewards` is the stricter judge a PRM is
meant to be: the k reference steps are k slots filled in order by the claim lines, each slot never
written is a step scoring `missing` (-1) at the end, and claim lines past the k-th are `wrong`, so
every completion of a problem has the same k + 1 steps plus one per extra claim. For GSM8K, which has
no reference chain, `clip` (arXiv 2410.15115's Clip) caps each claim step's reward at 0: "one true
unrelated line and stop" earns nothing for the line, and only the answer can pay.

Steps are character spans `(start, end)`, end exclusive; a scored step is `(char_end, reward)`
where char_end is that span's end. The trainer gives the reward to the token that holds the
step's last character, `char_end - 1` (DeepSeekMath's "end token of each step"); the answer's step
ends with the completion (`end_of_completion`: len(text) + 1), on its EOS.

Where the closing steps sit, and why. A token's advantage is the sum of the steps ending at or after it, so
a step's place decides which decisions it judges. The unwritten slots end on the last claim line's last
character, where the written chain stopped, not on the EOS: on the EOS they made the decision to stop
carry every slot the chain left out, so a correct short chain that stopped was charged more at its EOS
than a chain that went on wrongly and stopped later; every token of the chain still carries them. A
completion with no claim line has no chain to put them on: they end with it. A truncated completion's
answer scores below a wrong one: at `outcome_wrong`, stopping, padding and running to the cap from the
same prefix all got the same return, so nothing in the gradient said stop.

The evaluator never calls `eval`: it parses with `ast` and walks an allowlist (numbers, + - * /
// % ** and parentheses, unary minus), in exact `Fraction` arithmetic, with bounds on expression
length, parenthesis depth, exponent and number size checked before the work is done, so
`9**9**9**9` or 10,000 nested parentheses come back in milliseconds as "cannot check" (no claim).
"""

from __future__ import annotations

import ast
import re
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from grpo_cli.errors import ConfigError
from grpo_cli.rewards.outcome import answers_match, extract_answer, reference_answer

# an expression side longer than this is not a hand calculation; also bounds ast.parse's input
_MAX_SIDE_CHARS = 200
# nesting beyond this is not arithmetic a solution writes (ast.parse itself crashes near 200)
_MAX_PAREN_DEPTH = 16
# the largest number, in bits, an evaluation may hold (2**4096 ~ 10**1233)
_MAX_BITS = 4096
# the largest number literal, in characters
_MAX_LITERAL_CHARS = 60
# "=" signs read per step (each costs up to two side evaluations); a step with more is not hand
# arithmetic, and this bounds the time a hostile completion takes (~10 ms)
_MAX_EQUALS = 128

# A GSM8K calculator note <<48/2=24>>; its inside holds no < or >.
_NOTE = re.compile(r"<<([^<>]*)>>")
# A run of characters arithmetic is written in: digits, $ , . %, operators, parentheses, =, and an
# x or X between numbers ("0.2 x 50", "3x4"; not "3x-5", which is algebra); letters end a run, so
# "3 apples + 4 = 7" holds no claim.
_TIMES = r"(?:(?<=[\d)%])|(?<=[\d)%]\s))[xX](?=\s?[\d$(.])"
_RUN = re.compile(rf"(?:[\d$.,%\t ()+\-*/×÷^=−–·]|{_TIMES})+")
# "5 and 2/3" is a mixed number; rewritten as "(5+2/3)" before runs are read
_DIGIT = re.compile(r"\d")
_MIXED = re.compile(r"\b(\d+) and \(?(\d+/\d+)\)?")
# One token of an expression side: a number (thousands commas, $ before, % after), an operator or
# a parenthesis.
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?%?|\$?\.\d+%?)"
    r"|(?P<op>\*\*|//|[-+*/×÷^−–·%xX])|(?P<paren>[()]))"
)
# "b/c" written tight after a spaced "/" is one number: "3 / 1/4" means 3 / (1/4) = 12
_TIGHT_FRACTION = re.compile(r"/(\d+)(?![\d.]|\s*(?:\*\*|\^|/))")
_OPS = {"×": "*", "x": "*", "X": "*", "·": "*", "÷": "/", "^": "**", "−": "-", "–": "-"}
# what may trail or lead a side without being part of it: sentence punctuation
_EDGE = " \t,;:"


class _Unverifiable(Exception):
    """The side cannot be checked (not arithmetic, or too large to check safely)."""


def split_steps(text: str, pattern: str | None = None) -> list[tuple[int, int]]:
    """Character spans (start, end exclusive) of the steps of `text`, leading/trailing blanks trimmed.

    Default: each non-blank line is a step. With `pattern` (a regex such as r"Step \\d+:"), a step
    starts at each match; text before the first match, if not blank, is a step of its own.
    """
    if pattern is None:
        cuts = [m.start() + 1 for m in re.finditer("\n", text)]
        bounds = zip([0] + cuts, cuts + [len(text) + 1])
        spans = [(a, b - 1) for a, b in bounds]
    else:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"step pattern {pattern!r} is not a valid regex ({err}); "
                              f"fix the reward's `pattern` option") from None
        starts = sorted({0} | {m.start() for m in regex.finditer(text)})
        spans = list(zip(starts, starts[1:] + [len(text)]))
    steps = []
    for start, end in spans:
        chunk = text[start:end]
        stripped = chunk.strip()
        if stripped:
            begin = start + (len(chunk) - len(chunk.lstrip()))
            steps.append((begin, begin + len(stripped)))
    return steps


def _compile_side(side: str, first: bool) -> tuple[str, list[Fraction], bool]:
    """One side of a claim -> (python expression over names _n0.., their values, has a binary op)."""
    # sentence punctuation around a side ("So, 3 + 4 = 7.") is not part of it; ".5" is a number
    side = re.sub(r"^[.\s]+(?!\d)", "", side.strip(_EDGE))
    # a trailing full stop ends the sentence, not the number
    side = side[:-1].rstrip(_EDGE) if side.endswith(".") else side
    if not side or len(side) > _MAX_SIDE_CHARS:
        raise _Unverifiable
    # a run that starts with an operator continues prose ("3 apples + 4 = 7"), except a sign
    if first and (side[0] in "+*/×÷^·%xX" or (side[0] in "-−" and not side[1:2].strip())):
        raise _Unverifiable
    parts: list[str] = []
    values: list[Fraction] = []
    depth = binary = 0
    pos, prev, spaced_div = 0, "(", False
    while pos < len(side):
        match = _TOKEN.match(side, pos)
        if match is None or match.end() == pos:
            raise _Unverifiable
        pos = match.end()
        if match.group("num"):
            num = match.group("num").lstrip("$").replace(",", "")
            percent = num.endswith("%")
            num = num.rstrip("%")
            if len(num) > _MAX_LITERAL_CHARS:
                raise _Unverifiable
            value = Fraction(num) / (100 if percent else 1)
            tight = _TIGHT_FRACTION.match(side, pos) if spaced_div and not percent else None
            if tight:
                value, pos = value / int(tight.group(1)), tight.end()
            values.append(value)
            parts.append(f"_n{len(values) - 1}")
            prev = "num"
        elif match.group("op"):
            op = _OPS.get(match.group("op"), match.group("op"))
            # after an operator or "(" a minus is a sign; anything else is a binary operator
            binary += not (op == "-" and prev in ("op", "("))
            parts.append(op)
            spaced_div = op == "/" and (match.group(0)[0].isspace() or side[pos:pos + 1].isspace())
            prev = "op"
        else:
            paren = match.group("paren")
            depth += 1 if paren == "(" else -1
            if depth > _MAX_PAREN_DEPTH or depth < 0:
                raise _Unverifiable
            parts.append(paren)
            prev = paren
    return " ".join(parts), values, binary > 0


def _evaluate(node: ast.AST, values: list[Fraction]) -> Fraction:
    """Exact value of an allowlisted expression tree; _Unverifiable on anything else or too large."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, values)
    if isinstance(node, ast.Name) and node.id.startswith("_n"):
        return values[int(node.id[2:])]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, values)
    if not isinstance(node, ast.BinOp):
        raise _Unverifiable
    a, b = _evaluate(node.left, values), _evaluate(node.right, values)
    try:
        if isinstance(node.op, ast.Add):
            result = a + b
        elif isinstance(node.op, ast.Sub):
            result = a - b
        elif isinstance(node.op, ast.Mult):
            result = a * b
        elif isinstance(node.op, ast.Div):
            result = a / b
        elif isinstance(node.op, ast.FloorDiv):
            result = Fraction(a // b)
        elif isinstance(node.op, ast.Mod):
            result = a % b
        elif isinstance(node.op, ast.Pow):
            # integer exponents only; the result's size is known before computing it
            if b.denominator != 1:
                raise _Unverifiable
            size = max(a.numerator.bit_length(), a.denominator.bit_length(), 1)
            if a not in (0, 1, -1) and size * abs(b.numerator) > _MAX_BITS:
                raise _Unverifiable
            result = a ** b.numerator
        else:
            raise _Unverifiable
    except ZeroDivisionError:
        raise _Unverifiable from None
    if max(result.numerator.bit_length(), result.denominator.bit_length()) > _MAX_BITS:
        raise _Unverifiable
    return Fraction(result)


def _value(side: str, first: bool) -> tuple[Fraction, bool]:
    """(exact value, has a binary operator) of one side of a claim."""
    source, values, binary = _compile_side(side, first)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise _Unverifiable from None
    return _evaluate(tree, values), binary


def _shown(side: str) -> Decimal | None:
    """The number a side states, if it is one decimal literal ('$3.33' -> 3.33, '33.3%' -> 0.333)."""
    text = side.strip(_EDGE).rstrip(".").strip(_EDGE).lstrip("$").replace(",", "")
    percent = text.endswith("%")
    text = text.rstrip("%")
    try:
        if not re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", text):
            return None
        return Decimal(text) / 100 if percent else Decimal(text)
    except ArithmeticError:
        return None


def _holds(lhs: Fraction, rhs: Fraction, rhs_text: str) -> bool:
    """lhs == rhs exactly, or rhs is lhs rounded (half up) to the decimals rhs is written with.

    "10/3 = 3.33" holds; "7/2 = 3" does not (3.5 rounds to 4). A whole-number rhs needs the exact
    value ("10/3 = 3" is wrong): GSM8K writes rounded values with decimals.
    """
    if lhs == rhs:
        return True
    shown = _shown(rhs_text)
    if shown is None or shown.as_tuple().exponent >= 0:
        return False
    exact = Decimal(lhs.numerator) / Decimal(lhs.denominator)
    return exact.quantize(shown, rounding=ROUND_HALF_UP) == shown


def _claims(text: str, need_operator: bool, label_first: bool = False, drop_first: bool = False,
            drop_last: bool = False) -> list[bool]:
    """Truth of each checkable `a = b` claim in `text` (chains a = b = c give two claims).

    drop_first / drop_last: that side is glued to a word ("D3 = ...", "... = 5A") and is algebra.
    label_first: a first side without an operator follows a word ("Week 2 = 35 + 35") and is a label.
    """
    results = []
    sides = text.split("=")
    if len(sides) < 2:
        return results
    evaluated: list[tuple[Fraction, bool] | None] = []
    for i, side in enumerate(sides):
        try:
            evaluated.append(_value(side, first=i == 0))
        except (_Unverifiable, ValueError, ArithmeticError, RecursionError, MemoryError):
            evaluated.append(None)
    if drop_first or (label_first and evaluated[0] is not None and not evaluated[0][1]):
        evaluated[0] = None
    if drop_last:
        evaluated[-1] = None
    # "half of 48 = 24" reads as "48 = 24": a run makes claims only if a side has an operator
    if need_operator and not any(side[1] for side in evaluated if side is not None):
        return results
    for i in range(len(sides) - 1):
        left, right = evaluated[i], evaluated[i + 1]
        if left is not None and right is not None:
            results.append(_holds(left[0], right[0], sides[i + 1]))
    return results


def check_claims(step: str) -> list[bool]:
    """Truth of each arithmetic claim in one step: calculator notes first, then the prose.

    Reading stops after _MAX_EQUALS "=" signs; the claims read so far decide the step.
    """
    results: list[bool] = []
    budget = _MAX_EQUALS
    for note in _NOTE.finditer(step):
        budget -= note.group(1).count("=")
        if budget < 0:
            return results
        results += _claims(note.group(1), need_operator=False)
    # notes are masked so their insides are not read twice and "48/2 = <<...>>24" is not a claim
    prose = _NOTE.sub(lambda m: "|" * len(m.group(0)), step)
    prose = _MIXED.sub(r"(\1+\2)", prose)
    for run in _RUN.finditer(prose):
        chunk = run.group(0)
        equals = chunk.count("=")
        if not equals or not _DIGIT.search(chunk):
            continue
        budget -= equals
        if budget < 0:
            break
        # runs absorb spaces and tabs, so the characters around one are not blanks
        before = prose[run.start() - 1] if run.start() else " "
        after = prose[run.end()] if run.end() < len(prose) else " "
        results += _claims(
            chunk, need_operator=True,
            label_first=before.isalpha(),
            drop_first=chunk[0] not in _EDGE and (before.isalnum() or before in "_:"),
            drop_last=chunk[-1] not in _EDGE + "." and (after.isalnum() or after == "_"),
        )
    return results


def end_of_completion(text: str) -> int:
    """The char_end of a step that ends with the completion itself, past its last character: the trainer puts it
    on the completion's last token (its EOS), the decision to stop. A line's step ends on its own last character,
    so the tokens after it (another line, or the EOS) carry only the steps still to come."""
    return len(text) + 1


def _close(scored: list[tuple[int, float]], tail: int, answer, text: str, *, unwritten: int, missing: float,
           outcome_correct: float, outcome_wrong: float, outcome_truncated: float,
           truncated: bool) -> list[tuple[int, float]]:
    """The steps that close a completion: `missing` for each of the `unwritten` slots, at the end of the last claim
    line (where the written chain stopped; at `tail` when there is none), then the final answer's slot at `tail`
    (END_OF_COMPLETION, past the last character) when `answer` is given: `outcome_truncated` when `truncated` (it
    never finished), else right or wrong."""
    if not tail:
        return scored
    chain_end = scored[-1][0] if scored else tail
    closing = [(chain_end, float(missing))] * unwritten
    ref = reference_answer(answer)
    if ref is not None:
        if truncated:
            closing.append((tail, float(outcome_truncated)))
        else:
            right = answers_match(extract_answer(text), ref)
            closing.append((tail, float(outcome_correct if right else outcome_wrong)))
    return scored + closing


def verify_steps(text: str, answer=None, *, pattern: str | None = None, correct: float = 1.0,
                 wrong: float = -1.0, outcome_correct: float = 1.0, outcome_wrong: float = -1.0,
                 outcome_truncated: float = -2.0, truncated: bool = False,
                 clip: bool = False) -> list[tuple[int, float]]:
    """(char_end, reward) for each step of `text` that makes a claim, then the final answer's step.

    A line (or `pattern` step) with no claim it can check is not a step: it carries no reward and does not
    count in the group's normalization, so writing more of them changes nothing. With `answer`, the final
    answer is one more step at the end of the text (+outcome_correct / outcome_wrong; outcome_truncated when
    `truncated`).
    `clip` (arXiv 2410.15115's Clip): a claim step's reward is at most 0, so a true line earns nothing by
    itself and only the answer can be positive. A completion with no step at all (blank) gets [].
    """
    spans = split_steps(text, pattern)
    scored = []
    for start, end in spans:
        claims = check_claims(text[start:end])
        if claims:
            reward = correct if all(claims) else wrong
            scored.append((end, float(min(reward, 0.0) if clip else reward)))
    tail = end_of_completion(text) if spans else 0
    return _close(scored, tail, answer, text, unwritten=0, missing=0.0, outcome_correct=outcome_correct,
                  outcome_wrong=outcome_wrong, outcome_truncated=outcome_truncated, truncated=truncated)


def _flags(column, n: int) -> list[bool]:
    """The rollout's `truncated` column (None outside a rollout: nothing truncated)."""
    return [bool(t) for t in column] if column is not None else [False] * n


def step_rewards(prompts, completions, answer=None, truncated=None, pattern=None, correct=1.0, wrong=-1.0,
                 outcome_correct=1.0, outcome_wrong=-1.0, outcome_truncated=-2.0, wrong_if_truncated=True, clip=False,
                 **_) -> list[list[tuple[int, float]]]:
    """Process scorer for `ProcessReward`: `verify_steps` on each completion with its `answer`; with
    `wrong_if_truncated`, the answer step of a completion cut at max_new_tokens scores `outcome_truncated`."""
    answers = answer if answer is not None else [None] * len(completions)
    cut = _flags(truncated, len(completions))
    return [verify_steps(c, a, pattern=pattern, correct=correct, wrong=wrong, outcome_correct=outcome_correct,
                         outcome_wrong=outcome_wrong, outcome_truncated=outcome_truncated,
                         truncated=wrong_if_truncated and t, clip=clip)
            for c, a, t in zip(completions, answers, cut, strict=True)]


# one `a op b = c` claim, as the reference solutions of data=multistep write them
_CHAIN_CLAIM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)")


def _chain_step(match: re.Match) -> tuple[int, str, int, int]:
    a, op, b, c = match.groups()
    return int(a), op, int(b), int(c)


def chain_steps(text: str, solution: str, answer=None, *, correct: float = 1.0, wrong: float = -1.0,
                missing: float = -1.0, outcome_correct: float = 1.0, outcome_wrong: float = -1.0,
                outcome_truncated: float = -2.0, truncated: bool = False,
                clip: bool = False) -> list[tuple[int, float]]:
    """(char_end, reward) for the k slots of the reference chain `solution`, extra claims, and the answer.

    Only a line that makes a claim is a step. The k-th such line fills slot k: `correct` when its first
    `a op b = c` is the reference's k-th step (same numbers, same operator, true result) and every claim in
    it holds, else `wrong`; a claim line past the reference's last slot is `wrong` (an extra step). Each slot
    never written is a step of its own scoring `missing`, at the end of the last claim line (where the chain
    stopped), and the final answer one more at the end of the text (`verify_steps`'s answer step). So every
    completion of a problem has the same k + 1 steps, plus one per extra claim: a claim-free line changes no
    reward and no count. `clip`: claim steps at most 0.
    """
    reference = [_chain_step(m) for m in map(_CHAIN_CLAIM.search, solution.split("\n")) if m]
    spans = split_steps(text)
    scored, k = [], 0
    for start, end in spans:
        line = text[start:end]
        claims = check_claims(line)
        found = _CHAIN_CLAIM.search(line)
        if not claims and found is None:
            continue
        on_chain = found is not None and k < len(reference) and _chain_step(found) == reference[k]
        reward = correct if on_chain and all(claims) else wrong
        scored.append((end, float(min(reward, 0.0) if clip else reward)))
        k += 1
    tail = end_of_completion(text) if spans else 0
    return _close(scored, tail, answer, text, unwritten=max(len(reference) - k, 0), missing=missing,
                  outcome_correct=outcome_correct, outcome_wrong=outcome_wrong, outcome_truncated=outcome_truncated,
                  truncated=truncated)


def chain_step_rewards(prompts, completions, solution=None, answer=None, truncated=None, correct=1.0, wrong=-1.0,
                       missing=-1.0, outcome_correct=1.0, outcome_wrong=-1.0, outcome_truncated=-2.0,
                       wrong_if_truncated=True, clip=False, at_end=False, **_) -> list[list[tuple[int, float]]]:
    """Process scorer for `ProcessReward` on data with reference chains: `chain_steps` per completion. `at_end`:
    every step ends with the completion, so each token gets the same sum of the normalized steps: the same scores
    as one sequence-level reward (where credit goes, separated from how dense it is)."""
    if solution is None:
        raise ValueError("chain_step_rewards judges lines against each example's reference `solution`, and this "
                         "data has none; use data=multistep, or grpo_cli.rewards.steps.step_rewards")
    answers = answer if answer is not None else [None] * len(completions)
    cut = _flags(truncated, len(completions))
    scored = [chain_steps(c, s, a, correct=correct, wrong=wrong, missing=missing, outcome_correct=outcome_correct,
                          outcome_wrong=outcome_wrong, outcome_truncated=outcome_truncated,
                          truncated=wrong_if_truncated and t, clip=clip)
              for c, s, a, t in zip(completions, solution, answers, cut, strict=True)]
    if at_end:
        return [[(end_of_completion(c), r) for _, r in steps] for c, steps in zip(completions, scored, strict=True)]
    return scored
