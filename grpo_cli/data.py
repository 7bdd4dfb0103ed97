"""Datasets -> examples: the problems GRPO trains on and the held-out problems it is scored on.

Each task is built by Hydra from `conf/data/NAME.yaml` (a `_target_` node) and exposes two
sequences of example dicts (len() and integer indexing):

  - `.train`: the training stream. The trainer draws from it in its own seeded shuffled order.
  - `.heldout`: problems for evaluation. Never in `.train`: the two are disjoint by problem key
    (the operands and operators for arithmetic, the whitespace-normalized question for files).

An example is

    {"messages": [{"role": ..., "content": ...}, ...],  # the prompt, for tokenizer.apply_chat_template
     "question": "What is 34 + 57?",                     # the bare problem
     "answer": "91",                                     # the reference final answer, as a string
     "solution": "34 + 57 = 91\\n#### 91"}                # a worked reference (absent when the data has none)

`messages` is: a system turn (only when `system_prompt` is set), then `few_shot` solved problems
as user/assistant turns (the same ones for every prompt, never in train or held-out), then the user
turn, which is `instruction` with `{question}` replaced by the problem. Reward functions receive
every key except `messages` and `question`.

Tasks:
  - `ArithmeticTask`: procedural, seeded problems such as `34 + 57 * 2`; example i of the train
    stream is a pure function of (seed, i), generated on demand, so a 100k stream costs nothing.
  - `GSM8KTask`: GSM8K from a local JSONL/parquet file or folder, or the hub (`datasets`).
  - `JsonlTask`: any JSONL of problems, with configurable field names and answer extraction.
  - `MultiStepTask`: ArithmeticTask's problems as chains ("Compute 3 + 9 - 3 - 1."), solved one
    checkable `a op b = c` line per operation, for process supervision.

`build_task(cfg.data)` instantiates a composed `data` node (our errors unwrapped from Hydra's);
`load_task("arithmetic", seed=1)` builds one from its YAML with overrides, for scripts and tests.
"""

from __future__ import annotations

import codecs
import json
import math
import operator
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from grpo_cli.errors import ConfigError, DataError

Example = dict[str, Any]


def build_task(node: Any) -> _Task:
    """Instantiate a `data` config node; our ConfigError/DataError come out unwrapped."""
    from grpo_cli.config import build

    return build(node)


def load_task(name: str, **overrides: Any) -> _Task:
    """The task conf/data/NAME.yaml builds, with keys replaced by `overrides` (for scripts and tests)."""
    from omegaconf import OmegaConf

    from grpo_cli.config import CONF_DIR

    path = CONF_DIR / "data" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"no data config named {name!r}; use one of: {known}")
    return build_task(OmegaConf.merge(OmegaConf.load(path), overrides))


class PromptStream:
    """The training stream of a task: a seeded shuffle of `dataset`, reshuffled each epoch, endless.

    Position p of the stream is example perm_e[i] with (e, i) = divmod(p, len(dataset)) and perm_e
    a permutation seeded by (seed, e), so the stream is a pure function of (seed, position):
    `state_dict()` is the position, and a resumed run continues exactly. `shard(rank, world_size)`
    views the same stream for one of several data-parallel ranks: every rank advances the same
    global position and keeps its own contiguous slice of each draw.
    """

    def __init__(self, dataset: Sequence[Example], seed: int, position: int = 0) -> None:
        if len(dataset) == 0:
            raise DataError("the training set is empty; check data.path, data.limit and the filters")
        self.dataset = dataset
        self.seed = seed
        self.position = position
        self._perm: tuple[int, Any] | None = None  # (epoch, permutation) of the epoch last read

    def _permutation(self, epoch: int):
        import torch

        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.dataset), generator=generator))
        return self._perm[1]

    def __getitem__(self, position: int) -> Example:
        epoch, i = divmod(position, len(self.dataset))
        return self.dataset[int(self._permutation(epoch)[i])]

    def next(self, k: int) -> list[Example]:
        """The next k examples; the stream moves on by k."""
        out = [self[p] for p in range(self.position, self.position + k)]
        self.position += k
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed or state.get("size", len(self.dataset)) != len(self.dataset):
            raise ConfigError(f"the saved data stream (seed {state.get('seed')}, {state.get('size')} examples) is not "
                              f"this one (seed {self.seed}, {len(self.dataset)} examples); resume with the run's "
                              f"own data and trainer.seed")
        self.position = int(state["position"])

    def shard(self, rank: int, world_size: int) -> StreamShard:
        return StreamShard(self, rank, world_size)


class StreamShard:
    """Rank `rank` of `world_size`'s view of a PromptStream: `next(k)` draws k examples globally
    (every rank draws the same ones) and returns this rank's k / world_size, a contiguous slice."""

    def __init__(self, stream: PromptStream, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        self.stream, self.rank, self.world_size = stream, rank, world_size

    def next(self, k: int) -> list[Example]:
        if k % self.world_size:
            fix = k + self.world_size - k % self.world_size
            raise ConfigError(f"trainer.prompts_per_step ({k}) must divide by the number of ranks "
                              f"({self.world_size}); set trainer.prompts_per_step={fix}")
        per_rank = k // self.world_size
        start = self.stream.position + self.rank * per_rank
        out = [self.stream[p] for p in range(start, start + per_rank)]
        self.stream.position += k
        return out

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)


# ---- shared by every task ---------------------------------------------------------------------

def _check_int(name: str, value: Any, minimum: int, fix: Any, *, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        null = " or null" if nullable else ""
        raise ConfigError(f"data.{name} ({value!r}) must be an integer >= {minimum}{null}; set data.{name}={fix}")


class _Task:
    """Prompt settings shared by every task, and the chat messages they produce."""

    train: Sequence[Example]
    heldout: Sequence[Example]

    def __init__(self, *, seed: int, heldout_size: int, system_prompt: str | None, instruction: str,
                 few_shot: int) -> None:
        _check_int("seed", seed, 0, 0)
        _check_int("heldout_size", heldout_size, 1, 200)
        _check_int("few_shot", few_shot, 0, 0)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ConfigError(f"data.system_prompt ({system_prompt!r}) must be a string or null; "
                              f"set data.system_prompt=null")
        if not isinstance(instruction, str) or "{question}" not in instruction:
            raise ConfigError(f"data.instruction ({instruction!r}) must be a string containing {{question}}, "
                              f"which is replaced by the problem; set data.instruction='{{question}}'")
        self.seed = seed
        self.heldout_size = heldout_size
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.few_shot = few_shot
        # (question, assistant reply) pairs, the same earlier turns in every prompt
        self.shots: list[tuple[str, str]] = []

    def _user(self, question: str) -> str:
        # str.replace, not str.format: instructions may hold literal braces ("#### {N}")
        return self.instruction.replace("{question}", question)

    def _messages(self, question: str) -> list[dict[str, str]]:
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        for shot_question, reply in self.shots:
            messages.append({"role": "user", "content": self._user(shot_question)})
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": self._user(question)})
        return messages

    def _example(self, question: str, answer: str, solution: str | None) -> Example:
        example = {"messages": self._messages(question), "question": question, "answer": answer}
        if solution is not None:
            example["solution"] = solution
        return example

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(train={len(self.train)}, heldout={len(self.heldout)}, few_shot={self.few_shot})"


class _Generated(Sequence):
    """`length` examples made on demand: item i is `make(i)`, a pure function of the index."""

    def __init__(self, length: int, make: Callable[[int], Example]) -> None:
        self._length = length
        self._make = make

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._length))]
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"example {index} is out of range for {self._length} examples")
        return self._make(i)


# ---- arithmetic -------------------------------------------------------------------------------

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
                 instruction: str, few_shot: int) -> None:
        super().__init__(seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot)
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


# ---- problems from files ----------------------------------------------------------------------

class _Row(NamedTuple):
    where: str  # "FILE:LINE", for error messages
    question: str
    answer: str
    solution: str | None


Record = tuple[str, dict]  # (where, the raw record)

# a number with thousands separators, "1,000" -> "1000"; other answers keep their commas
_GROUPED_NUMBER = re.compile(r"[-+]?\$?\d{1,3}(,\d{3})+(\.\d+)?")


def _clean_answer(text: str) -> str:
    text = text.strip()
    return text.replace(",", "") if _GROUPED_NUMBER.fullmatch(text) else text


def _not_finite(answer: str) -> bool:
    """"NaN", "inf", "-Infinity", "1e999": text that Python reads as a number that is not finite."""
    try:
        return not math.isfinite(float(answer))
    except ValueError:
        return False


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    # bytes, decoded line by line, so that bad bytes are reported by line, not by offset in the file
    with path.open("rb") as lines:
        for n, raw in enumerate(lines, 1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]  # the byte-order mark some Windows editors write
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} "
                                f"of the line); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{n}: not valid JSON: {err}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{n}: expected one JSON object per line, got {type(record).__name__}")
            records.append((f"{path}:{n}", record))
    return records


def _read_parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to JSONL)") from None
    return [(f"{path} row {n}", record) for n, record in enumerate(pq.read_table(path).to_pylist(), 1)]


def _read(paths: list[Path]) -> list[Record]:
    records: list[Record] = []
    for path in paths:
        records += _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
    return records


def _split_files(folder: Path, split: str) -> list[Path]:
    """`split`.jsonl, `split`.parquet, or hub-style shards `**/split-00000-of-00001.parquet`."""
    for pattern in (f"{split}.jsonl", f"{split}.parquet", f"**/{split}-*.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def read_local(path: str, split: str) -> tuple[list[Record], list[Record] | None, str]:
    """(train records, test records or None, a name for messages) from a file or a folder.

    A folder is read as `split` plus, when present, `test`, which then serves as the held-out set.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"{root} does not exist; set data.path=... to a .jsonl or .parquet file "
                        f"or a folder holding {split}.jsonl")
    if root.is_file():
        return _read([root]), None, str(root)
    train_files = _split_files(root, split)
    if not train_files:
        raise DataError(f"{root} holds no {split}.jsonl, {split}.parquet or {split}-*.parquet; "
                        f"set data.path=... to the file itself")
    test_files = _split_files(root, "test") if split != "test" else []
    return _read(train_files), (_read(test_files) if test_files else None), str(root)


def _question_key(question: str) -> str:
    return " ".join(question.split()).lower()


class _RecordTask(_Task):
    """Problems from records: a seeded held-out slice (or a test split), few-shot and train,
    disjoint by question. Subclasses say where the records come from and what the fields are."""

    def __init__(self, train: list[Record], test: list[Record] | None, source: str, *,
                 question_field: str, answer_field: str, solution_field: str | None, answer_regex: str | None,
                 field_fix: str | None, limit: int | None, **prompt: Any) -> None:
        super().__init__(**prompt)
        _check_int("limit", limit, 0, 1000, nullable=True)
        try:
            pattern = None if answer_regex is None else re.compile(answer_regex)
        except (re.error, TypeError) as err:
            raise ConfigError(f"data.answer_regex ({answer_regex!r}) is not a valid regular expression ({err}); "
                              f"fix it or set data.answer_regex=null") from None
        self.source = source
        self.limit = limit
        self._fields = {"question": question_field, "answer": answer_field, "solution": solution_field}
        self._pattern = pattern
        # how to fix a missing field; None: name the data.ROLE_field setting
        self._field_fix = field_fix
        # records whose answer the pattern does not find (or finds empty); counted, not fatal
        self.skipped = 0

        if not train:
            raise DataError(f"{source} holds no records (an empty file, or blank lines only); set data.path=... "
                            f"to a file with one problem per line")
        rows = self._rows(train)
        if not rows:
            if self._field_fix is not None:  # a task whose fields and pattern are fixed (GSM8K)
                fix = f"no answer matches {answer_regex!r}; {self._field_fix}"
            elif pattern is not None:
                fix = (f"data.answer_regex ({answer_regex!r}) finds no answer in field {answer_field!r}; fix it or "
                       f"set data.answer_regex=null")
            else:
                fix = f"check data.question_field ({question_field!r}) and data.answer_field ({answer_field!r})"
            raise DataError(f"{source} has no examples after answer extraction ({len(train)} records, "
                            f"{self.skipped} without a question or an answer); {fix}")
        order = list(range(len(rows)))
        random.Random(self.seed).shuffle(order)
        held_ids = [] if test is not None else sorted(order[:self.heldout_size])
        held = self._rows(test) if test is not None else [rows[j] for j in held_ids]
        if not held:
            raise DataError(f"{source}: the test split has no examples; remove it or fix it")
        # a question held out (or shown as a shot) must not reappear elsewhere, even as a duplicate line
        held_keys = {_question_key(r.question) for r in held}
        shot_ids = [j for j in order[len(held_ids):] if _question_key(rows[j].question) not in held_keys]
        shot_ids = shot_ids[:self.few_shot]
        shots = [rows[j] for j in shot_ids]
        reserved = held_keys | {_question_key(r.question) for r in shots}
        taken = set(held_ids) | set(shot_ids)
        kept = [r for j, r in enumerate(rows) if j not in taken and _question_key(r.question) not in reserved]
        usable = len(kept)
        if limit is not None:
            kept = kept[:limit]
        if not kept or len(shots) < self.few_shot:
            distinct = len({_question_key(r.question) for r in rows})
            if usable and len(shots) == self.few_shot:  # only data.limit cut them all
                fix = "set data.limit=null (all of them) or a number >= 1"
            elif test is None and distinct > self.few_shot + 1:
                # h held-out and f few-shot rows hold at most h + f questions, so h <= distinct - f - 1 leaves one
                fix = (f"set data.heldout_size={distinct - self.few_shot - 1} or lower (or lower data.few_shot); "
                       f"lines repeating a held-out or few-shot question are not trained on")
            else:
                fix = ("held-out, few-shot and training problems must have different questions, and a question "
                       "repeated on many lines counts once; add problems with other questions")
            raise DataError(
                f"{source} has no training examples after removing {len(held)} held-out and {len(shots)} few-shot "
                f"problems{'' if limit is None else f' and applying data.limit={limit}'} ({len(rows)} usable records, "
                f"{distinct} distinct questions); {fix}")
        self.shots = [(r.question, self._shot_reply(r)) for r in shots]
        self.heldout = [self._example(r.question, r.answer, r.solution) for r in held]
        self.train = [self._example(r.question, r.answer, r.solution) for r in kept]

    def _shot_reply(self, row: _Row) -> str:
        return row.solution if row.solution is not None else row.answer

    def _field(self, where: str, record: dict, role: str) -> str:
        field = self._fields[role]
        if field not in record:
            fix = self._field_fix or f"set data.{role}_field=... to the name this file uses"
            raise DataError(f"{where}: missing field {field!r}; {fix}")
        value = record[field]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: field {field!r} must be a string or a number, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(f"{where}: field {field!r} is {value} (often a missing value written as NaN); "
                            f"fix or remove this line")
        return str(value)

    def _rows(self, records: list[Record]) -> list[_Row]:
        rows = []
        for where, record in records:
            question = self._field(where, record, "question")
            raw = self._field(where, record, "answer")
            if self._pattern is not None:
                # the last match wins: a worked answer ends with the final one
                matches = list(self._pattern.finditer(raw))
                raw = matches[-1].group(1 if self._pattern.groups else 0) if matches else ""
            answer = _clean_answer(raw)
            if _not_finite(answer):  # no completion can be scored against NaN or inf
                raise DataError(f"{where}: the answer is {answer!r}, not a finite number (often a missing value "
                                f"written as NaN); fix or remove this line")
            if not answer or not question.strip():
                self.skipped += 1
                continue
            solution = None if self._fields["solution"] is None else self._field(where, record, "solution")
            rows.append(_Row(where, question, answer, solution))
        return rows


# GSM8K's reference answers end with "#### 72"; calculator notes look like "<<48/2=24>>"
_GSM8K_ANSWER = r"####[ \t]*([^\n]+)"
_CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")


def _hub_gsm8k(split: str) -> tuple[list[Record], list[Record] | None, str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.path is null, so GSM8K comes from the hub dataset openai/gsm8k, which needs the "
                          "`datasets` package: pip install datasets; or set data.path=/path/to/gsm8k/train.jsonl"
                          ) from None
    try:
        hub = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as err:  # offline, gated, renamed, ...: all fixed the same way
        raise DataError(f"could not load openai/gsm8k (main) from the hub: {err}; "
                        f"set data.path=/path/to/gsm8k/train.jsonl to use a local copy") from None
    if split not in hub:
        raise ConfigError(f"data.split ({split!r}) is not a split of openai/gsm8k ({', '.join(hub)}); "
                          f"set data.split=train")

    def records(name: str) -> list[Record]:
        return [(f"openai/gsm8k {name} row {n}", dict(r)) for n, r in enumerate(hub[name], 1)]

    test = records("test") if split != "test" and "test" in hub else None
    return records(split), test, f"openai/gsm8k ({split})"


class GSM8KTask(_RecordTask):
    """GSM8K (grade-school math): `answer` is the number after the last '####', commas removed;
    `solution` is the full reference text. Few-shot replies drop the "<<48/2=24>>" calculator notes."""

    def __init__(self, *, path: str | None, split: str, heldout_size: int, limit: int | None, seed: int,
                 system_prompt: str | None, instruction: str, few_shot: int) -> None:
        if not isinstance(split, str) or not split:
            raise ConfigError(f"data.split ({split!r}) must be a split name; set data.split=train")
        train, test, source = _hub_gsm8k(split) if path is None else read_local(str(path), split)
        super().__init__(train, test, source, question_field="question", answer_field="answer",
                         solution_field="answer", answer_regex=_GSM8K_ANSWER,
                         field_fix="GSM8K lines hold 'question' and 'answer'; for another layout use "
                                   "data=jsonl with data.question_field=... data.answer_field=...",
                         limit=limit, seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot)
        self.path = path
        self.split = split

    def _shot_reply(self, row: _Row) -> str:
        return _CALCULATOR_NOTE.sub("", row.solution or row.answer)


class JsonlTask(_RecordTask):
    """Problems from any local JSONL (or a folder with train.jsonl and, optionally, test.jsonl)."""

    def __init__(self, *, path: str, question_field: str, answer_field: str, solution_field: str | None,
                 answer_regex: str | None, heldout_size: int, limit: int | None, seed: int,
                 system_prompt: str | None, instruction: str, few_shot: int) -> None:
        if not path:
            raise ConfigError("data.path is required; set data.path=/path/to/problems.jsonl")
        for name, value in (("question_field", question_field), ("answer_field", answer_field)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{name} ({value!r}) must be a field name; set data.{name}=...")
        train, test, source = read_local(str(path), "train")
        super().__init__(train, test, source, question_field=question_field, answer_field=answer_field,
                         solution_field=solution_field, answer_regex=answer_regex, field_fix=None, limit=limit,
                         seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot)
        self.path = path


# ---- multi-step arithmetic --------------------------------------------------------------------

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
                 instruction: str, few_shot: int) -> None:
        if not isinstance(nonnegative, bool):
            raise ConfigError(f"data.nonnegative ({nonnegative!r}) must be true or false; set data.nonnegative=true")
        # read by _draw, which the parent's constructor already calls
        self.nonnegative = nonnegative
        super().__init__(num_operands=num_operands, min_digits=min_digits, max_digits=max_digits,
                         operators=operators, style="bare", seed=seed, train_size=train_size,
                         heldout_size=heldout_size, system_prompt=system_prompt, instruction=instruction,
                         few_shot=few_shot)

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
