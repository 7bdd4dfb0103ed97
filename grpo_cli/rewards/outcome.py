"""Outcome rewards for math answers: extract the final answer, compare it, score format and length.

Each reward function has the signature `fn(prompts, completions, **columns) -> list[float | None]`
(see `grpo_cli.rewards`) and is built from YAML as a `_partial_: true` node, so its options live
there. DeepSeekMath (arXiv 2402.03300, §4.1) uses a learned reward model; like most open GRPO
recipes (DeepSeek-R1, TRL, verl) we default to these rule-based rewards instead. `length_penalty`
is DAPO's soft overlong punishment (arXiv 2503.14476, §3.4), not in the GRPO paper.

`extract_answer` looks, in priority order, for `#### N` (GSM8K), `\\boxed{...}`, "the answer is N" /
"answer: N", and else the last number; the last occurrence of a marker wins, because models often
restate the question's numbers before the answer. `answers_match` compares two answers exactly as
numbers first (fast: all of GSM8K takes well under a second) and falls back to math-verify for
anything that is not a plain number, with math-verify's own signal-based timeouts off when called
off the main thread (the combiner in `grpo_cli.rewards` times the whole call instead).
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

from math_verify import parse, verify

from grpo_cli.errors import ConfigError

log = logging.getLogger(__name__)

# A number as people write it: optional sign and $, thousands commas, decimals, an attached
# fraction ("3/4") and %. A sign right after a word, digit or ")" is subtraction, not a sign.
_NUMBER = re.compile(
    r"(?:(?<![\w)\]])(?P<sign>-))?\$?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:/(?P<den>\d+(?:\.\d+)?)(?!\d|\.\d|/))?"
)
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}$")
_PLAIN_NUMBER = re.compile(r"^-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?$")
_ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)
# latex spacing and escapes that carry no value
_LATEX_NOISE = re.compile(r"\\[,!;: ]|\\left|\\right|\\\$|\\%|\$|%|\\text\{\s*\}")
# an answer longer than this is not a final answer; also bounds the work math-verify gets
_MAX_ANSWER_CHARS = 200


def _number_text(match: re.Match) -> str:
    """'-$1,234.50' -> '-1234.50'; '3/4' kept as a fraction."""
    text = (match.group("sign") or "") + match.group("num").replace(",", "")
    if match.group("den"):
        text += "/" + match.group("den")
    return text


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent or unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def _clean(fragment: str) -> str | None:
    """A final-answer fragment (after ####, inside \\boxed) -> its normal form, or None if empty.

    A plain number or a numeric \\frac becomes '-1234.5' / '3/4'; anything else (an expression, a
    set, a letter) is returned with latex spacing and $ % stripped, for math-verify to judge.
    """
    text = _LATEX_NOISE.sub("", fragment).strip().rstrip(".").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text).strip()
    frac = _FRAC.match(text.replace(" ", ""))
    if frac:
        sign, num, den = frac.groups()
        text = f"{sign}{num}/{den}".replace(",", "").replace("--", "")
    if _PLAIN_NUMBER.match(text) and any(c.isdigit() for c in text):
        return text.replace(",", "")
    # "x = 5", "18 dollars": the number is the answer; "2x+3", "\\sqrt{2}" go to math-verify as text
    bare = re.sub(r"^[A-Za-z]\w*\s*=\s*", "", text)
    number = _NUMBER.search(bare)
    if number and re.fullmatch(r"[A-Za-z\s.,:;']*", bare[:number.start()] + bare[number.end():]):
        return _number_text(number)
    return text or None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, normalised ('1,000.' -> '1000'); None if there is none."""
    if not text:
        return None
    marker = text.rfind("####")
    if marker >= 0:
        line = text[marker + 4:].split("\n", 1)[0]
        answer = _clean(line)
        if answer is not None:
            return answer
    boxed = _boxed(text)
    if boxed is not None:
        answer = _clean(boxed)
        if answer is not None:
            return answer
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        rest = text[phrases[-1].end():].split("\n", 1)[0]
        frac = re.search(r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}", rest)
        number = _NUMBER.search(rest)
        if frac and (number is None or frac.start() <= number.start()):
            return _clean(frac.group(0))
        if number:
            return _number_text(number)
    numbers = list(_NUMBER.finditer(text))
    return _number_text(numbers[-1]) if numbers else None


def _as_fraction(text: str) -> Fraction | None:
    """'1,000' / '3.0' / '-3/4' / '$5' / '50%' -> an exact Fraction; None if not a plain number."""
    text = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    text = text[:-1] if text.endswith("%") else text
    if not text or len(text) > 64 or not _PLAIN_NUMBER.match(text) or not any(c.isdigit() for c in text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify(pred: str, ref: str) -> bool:
    # math-verify times out with signal.alarm, which only works on the main thread; off it, the
    # reward's own thread timeout (OutcomeReward.timeout_s) bounds the call instead
    on_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if on_main else None

    def parsed(text: str):
        # latex extraction wants delimiters; plain expressions parse without
        result = parse(f"${text}$", parsing_timeout=timeout)
        return result or parse(text, parsing_timeout=timeout)

    return bool(verify(parsed(ref), parsed(pred), timeout_seconds=timeout))


def answers_match(pred: str | None, ref: str | None) -> bool:
    """Whether two extracted answers are equal: exactly as numbers, else by math-verify. Never raises."""
    if pred is None or ref is None:
        return False
    pred, ref = str(pred).strip(), str(ref).strip()
    if not pred or not ref:
        return False
    a, b = _as_fraction(pred), _as_fraction(ref)
    if a is not None and b is not None:
        return a == b
    if pred == ref:
        return True
    if len(pred) > _MAX_ANSWER_CHARS or len(ref) > _MAX_ANSWER_CHARS:
        return False
    try:
        return _math_verify(pred, ref)
    except Exception as err:  # math-verify and sympy raise many types on odd input
        log.debug("math-verify failed on %r vs %r: %s", pred, ref, err)
        return False


def reference_answer(answer) -> str | None:
    """The reference answer of one example: a number, '72', or a whole '... #### 72' solution; None: none."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text or "\\boxed" in text:
        return extract_answer(text)
    return text.strip()


def accuracy(prompts, completions, answer, correct=1.0, incorrect=0.0, truncated=None, wrong_if_truncated=False,
             **_):
    """`correct` when the completion's final answer equals the example's `answer`, else `incorrect`.

    An example whose answer is None gets no score (None); a completion with no answer is incorrect. With
    `wrong_if_truncated`, a completion cut at max_new_tokens (the rollout's `truncated` column) is incorrect
    whatever number it ended on: it never finished, and rewarding its last number pays for rambling.
    """
    cut = [bool(t) for t in truncated] if truncated is not None and wrong_if_truncated else [False] * len(completions)
    scores: list[float | None] = []
    for completion, ref, stopped in zip(completions, answer, cut, strict=True):
        ref = reference_answer(ref)
        if ref is None:
            scores.append(None)
        else:
            right = not stopped and answers_match(extract_answer(completion), ref)
            scores.append(correct if right else incorrect)
    return scores


def format_reward(prompts, completions, pattern=r"####\s*-?[\d,\.]+\s*$", match=1.0, miss=0.0, **_):
    """`match` when `re.search(pattern, completion)` finds the pattern, else `miss`.

    `$` is the end of the completion (no re.MULTILINE); put `(?m)` in the pattern to change that.
    """
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"reward format pattern {pattern!r} is not a valid regex ({err}); "
                          f"fix reward.functions.format.pattern") from None
    return [match if regex.search(c) else miss for c in completions]


def length_penalty(prompts, completions, completion_length, max_length, buffer, penalty=1.0, **_):
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) on the completion length L in tokens.

    With L_max = max_length and L_cache = buffer:
        0                                   L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache     L_max - L_cache < L <= L_max     (0 down to -1, linear)
        -1                                  L > L_max
    times `penalty` (the paper's is 1), added to the correctness reward. L comes from the
    `completion_length` column (the sampled tokens, EOS included); a None length gets no score.
    Generation stops at sampler.max_new_tokens, so L_max = max_new_tokens makes a cut completion
    score -penalty, as in the paper (L_max 20,480 with a 4,096-token buffer).
    """
    if not 0 < buffer <= max_length:
        raise ConfigError(f"length_penalty buffer ({buffer}) must be in (0, max_length={max_length}]; "
                          f"set reward.functions.length.buffer to about max_length / 4")
    start = max_length - buffer
    scores: list[float | None] = []
    for length in completion_length:
        if length is None:
            scores.append(None)
        elif length <= start:
            scores.append(0.0)
        elif length <= max_length:
            scores.append(-(length - start) / buffer * penalty)
        else:
            scores.append(-float(penalty))
    return scores
