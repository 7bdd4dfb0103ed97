"""Tasks read from files: GSM8K (local JSONL/parquet or the hub) and any JSONL of problems."""

from __future__ import annotations

import codecs
import json
import math
import random
import re
from pathlib import Path
from typing import Any, NamedTuple

from grpo_cli.data.hf import load_hub
from grpo_cli.data.task import _check_int, _Task, check_regular
from grpo_cli.errors import ConfigError, DataError


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
    check_regular(root)
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
        held_ids = [] if test is not None else sorted(
            order[:self._heldout_count(len(rows), len({_question_key(r.question) for r in rows}), source)])
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
        # FILE:LINE of each training then held-out example, for prompt_rows
        self._where = [r.where for r in kept] + [r.where for r in held]

    def prompt_rows(self) -> list[tuple[str, list[dict]]]:
        return [(where, e["messages"]) for where, e in zip(self._where, [*self.train, *self.heldout])]

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
        import datasets  # noqa: F401 (load_hub loads with it; asked here to give GSM8K's own fix)
    except ImportError:
        raise ConfigError("data.path is null, so GSM8K comes from the hub dataset openai/gsm8k, which needs the "
                          "`datasets` package: pip install datasets; or set data.path=/path/to/gsm8k/train.jsonl"
                          ) from None
    hub = load_hub("openai/gsm8k", "main")  # no network: one line in seconds, saying how to use a local copy
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

    def __init__(self, *, path: str | None, split: str, heldout_size: int | str, limit: int | None, seed: int,
                 system_prompt: str | None, instruction: str, few_shot: int,
                 chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        if not isinstance(split, str) or not split:
            raise ConfigError(f"data.split ({split!r}) must be a split name; set data.split=train")
        train, test, source = _hub_gsm8k(split) if path is None else read_local(str(path), split)
        super().__init__(train, test, source, question_field="question", answer_field="answer",
                         solution_field="answer", answer_regex=_GSM8K_ANSWER,
                         field_fix="GSM8K lines hold 'question' and 'answer'; for another layout use "
                                   "data=jsonl with data.question_field=... data.answer_field=...",
                         limit=limit, seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot,
                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        self.path = path
        self.split = split

    def _shot_reply(self, row: _Row) -> str:
        return _CALCULATOR_NOTE.sub("", row.solution or row.answer)


class JsonlTask(_RecordTask):
    """Problems from any local JSONL (or a folder with train.jsonl and, optionally, test.jsonl)."""

    def __init__(self, *, path: str, question_field: str, answer_field: str, solution_field: str | None,
                 answer_regex: str | None, heldout_size: int | str, limit: int | None, seed: int,
                 system_prompt: str | None, instruction: str, few_shot: int,
                 chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        if not path:
            raise ConfigError("data.path is required; set data.path=/path/to/problems.jsonl")
        for name, value in (("question_field", question_field), ("answer_field", answer_field)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{name} ({value!r}) must be a field name; set data.{name}=...")
        train, test, source = read_local(str(path), "train")
        super().__init__(train, test, source, question_field=question_field, answer_field=answer_field,
                         solution_field=solution_field, answer_regex=answer_regex, field_fix=None, limit=limit,
                         seed=seed, heldout_size=heldout_size, system_prompt=system_prompt,
                         instruction=instruction, few_shot=few_shot,
                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        self.path = path

