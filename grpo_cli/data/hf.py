"""Any dataset the `datasets` library reads, in TRL's two prompt formats (`data=hf`).

    grpo train data=hf data.path=prompts.jsonl reward=custom 'reward.funcs=[my_rewards.fn]'
    grpo train data=hf data.path=openai/gsm8k data.name=main data.prompt_field=question reward=gsm8k

`data.path` is a hub name, a .jsonl/.json/.csv/.parquet file, a folder of such files (`train.jsonl`,
`test.jsonl`, hub-style `data/train-*.parquet`) or a folder written by `Dataset.save_to_disk`; it is
loaded once (a local path holding anything but regular files and folders, links followed, is refused before it is
opened: a FIFO blocks its reader forever, /dev/zero never ends). The prompt column (`data.prompt_field`) holds, as in
TRL's GRPOTrainer, either

  - a string ("standard"): the user turn, after a `data.system_prompt` turn when one is set, or
  - a list of `{"role", "content"}` messages ("conversational"): used as they are.

Every other column rides along in the example under its own name, and so reaches every reward
function as a keyword list; an `answer` column, when there is one, is the reference that the
accuracy reward and `grpo eval`'s accuracy read. The held-out set is `data.test_split` when the
dataset has it, else a seeded `heldout_size` slice of `data.split`; a training row whose prompt is
also held out is dropped, so training never draws a held-out prompt.

An example is `{"messages": [...], "question": TEXT, "prompt": AS_GIVEN, **other columns}`: `messages`
for the chat template, `question` the prompt's text for logs and tables (the last user turn of a
conversational prompt), and `prompt` the prompt as the dataset gives it, which a TRL-style reward
function receives as `prompts` (grpo_cli.rewards.user). Rows are read from the Arrow table on demand.

A hub name needs the network: without it, one line says so and how to pass a local copy, after a
3 s connection check rather than the hub client's minute of retries.
"""

from __future__ import annotations

import csv
import json
import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from huggingface_hub import constants

from grpo_cli.data.task import Example, _check_int, _Generated, _Task, check_regular
from grpo_cli.errors import ConfigError, DataError

# file suffix -> the `datasets` builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# an example's own keys (see the module docstring) and the columns the reward call adds (grpo_cli.rewards.call.score,
# user.TRLFunction): a dataset column of one of these names would be overwritten, so it is refused
RESERVED = ("messages", "question", "prompt", "prompts", "completions", "completion_ids", "completion_length",
            "truncated")

# seconds the hub may take to accept a connection before a hub name counts as unreachable
_HUB_CHECK_S = 3.0


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_reachable(endpoint: str) -> bool:
    """Whether the hub's host accepts a TCP connection within a few seconds (a proxy in the environment: assume so)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=_HUB_CHECK_S).close()
    except OSError:
        return False
    return True


def _root_cause(err: BaseException) -> str:
    """The innermost error's first line: `datasets` wraps a parse error in "An error occurred while generating"."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def load_hub(path: str, name: str | None = None):
    """`datasets.load_dataset(path, name)` from the hub, or one DataError that says how to use a local copy."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"loading {path} from the hub needs the `datasets` package: pip install datasets") from None
    local = (f"where there is network, save it with `python -c \"import datasets; datasets.load_dataset('{path}'"
             f"{'' if name is None else f', {name!r}'}).save_to_disk('DIR')\"`, copy DIR here and set data.path=DIR "
             f"(or a local .jsonl/.parquet file)")
    offline = _flag("HF_HUB_OFFLINE") or _flag("HF_DATASETS_OFFLINE")  # a copy in the HF cache, no network wanted
    if not offline and not _hub_reachable(constants.ENDPOINT):
        raise DataError(f"{path} is not a local file or folder, and the hub ({constants.ENDPOINT}) cannot be reached "
                        f"(no network?); {local}; a copy already in the HF cache loads with HF_HUB_OFFLINE=1")
    try:
        return datasets.load_dataset(path, name)
    except Exception as err:  # not found, gated, offline and not cached, a config name missing, ...
        raise DataError(f"could not load {path}{'' if name is None else f' ({name})'} from the hub: "
                        f"{_root_cause(err)}; {local}") from None


def _load(path: str, name: str | None) -> tuple[dict, str]:
    """({split name: Dataset}, a name for messages); a single file or saved Dataset is one split, None."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("data=hf needs the `datasets` package: pip install datasets") from None
    local = Path(path).expanduser()
    if not local.exists():
        if local.suffix in BUILDERS or path.startswith(("/", ".", "~")) or local.drive:
            raise DataError(f"data.path ({path}) does not exist (looked in {Path.cwd()}); set data.path=... to a "
                            f".jsonl/.json/.csv/.parquet file, a folder of them, a save_to_disk folder or a hub name")
        loaded = load_hub(path, name)
        return dict(loaded), path + ("" if name is None else f" ({name})")
    check_regular(local)
    try:
        if local.is_file():
            if local.suffix not in BUILDERS:
                raise DataError(f"data.path ({path}) is a {local.suffix or 'suffix-less'} file; data=hf reads "
                                f"{', '.join(BUILDERS)} files, folders of them and save_to_disk folders")
            if local.suffix != ".parquet" and _blank(local):  # `datasets` would say StopIteration
                raise DataError(f"{path} is empty (no rows); set data.path=... to a file with one prompt per row")
            return {None: datasets.load_dataset(BUILDERS[local.suffix], data_files=str(local), split="train")}, path
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():  # Dataset(Dict).save_to_disk
            loaded = datasets.load_from_disk(str(local))
        else:
            loaded = datasets.load_dataset(str(local))
    except DataError:
        raise
    except Exception as err:  # unreadable JSON, mixed column types, an empty folder, bytes that are not UTF-8, ...
        bad = _csv_not_utf8(local) if local.is_file() and local.suffix == ".csv" else None
        raise DataError(bad or f"could not read {path}: {_root_cause(err)}") from None
    return (dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {None: loaded}), path


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def _not_utf8(dataset, field: str, source: str) -> None:
    """A DataError naming the first row whose `field` holds bytes that are not UTF-8 (the error path: each row made
    into Python objects until one fails)."""
    for n, value in enumerate(dataset.data.column(field), 1):
        try:
            value.as_py()
        except UnicodeDecodeError as err:
            raise DataError(f"{source} row {n}: {field!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x}); "
                            f"save the file as UTF-8") from None


def _decoded(dataset, field: str, source: str) -> list:
    """Every row's `field`, read once; a DataError naming the first row whose bytes are not UTF-8 (Arrow's JSON
    reader keeps them; they fail only when read)."""
    try:
        return list(dataset[field])
    except UnicodeDecodeError:
        _not_utf8(dataset, field, source)
    raise DataError(f"{source}: column {field!r} is not UTF-8 text; save the file as UTF-8")


def _check_utf8(dataset, field: str, source: str) -> None:
    """A DataError naming the first row whose `field` (any type: a string, or strings in a list or a struct) holds
    bytes that are not UTF-8. Every column reaches the reward functions, and such a row failed only when a step drew
    it; Arrow's full validation reads the bytes without making Python objects of them."""
    try:
        dataset.data.column(field).validate(full=True)
    except Exception:  # pyarrow.ArrowInvalid: find the row (another invalidity is no decoding error: left alone)
        _not_utf8(dataset, field, source)


def _csv_not_utf8(path: Path) -> str | None:
    """"FILE row N: 'COLUMN' is not UTF-8 text (byte 0xNN) ..." for a CSV file's first field whose bytes are not
    UTF-8 (Arrow's CSV reader names only an offset in a block), or None."""
    with path.open(newline="", encoding="utf-8", errors="surrogateescape") as lines:
        rows = csv.reader(lines)
        header = next(rows, [])
        for n, row in enumerate(rows, 1):
            for j, value in enumerate(row):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as err:  # a byte that did not decode is kept as U+DC80..U+DCFF
                    column, byte = header[j] if j < len(header) else f"column {j + 1}", ord(value[err.start]) - 0xDC00
                    return f"{path} row {n}: {column!r} is not UTF-8 text (byte 0x{byte:02x}); save the file as UTF-8"
    return None


def _blank(path: Path) -> bool:
    """Whether a text file holds nothing but whitespace (read until its first other byte)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _prompt_key(prompt: Any) -> str:
    """Two rows with this key ask the same thing (whitespace and case aside)."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return " ".join(text.split()).lower()


class HFTask(_Task):
    """A `datasets` dataset as train and held-out examples; see the module docstring."""

    def __init__(self, *, path: str, name: str | None, split: str, test_split: str | None, prompt_field: str,
                 heldout_size: int | str, limit: int | None, seed: int, system_prompt: str | None,
                 chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        super().__init__(seed=seed, heldout_size=heldout_size, system_prompt=system_prompt, instruction="{question}",
                         few_shot=0, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        _check_int("limit", limit, 1, 1000, nullable=True)
        if not isinstance(path, str) or not path:
            raise ConfigError(f"data.path ({path!r}) must be a file, a folder or a hub name; "
                              f"set data.path=prompts.jsonl")
        for key, value in (("split", split), ("prompt_field", prompt_field)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"data.{key} ({value!r}) must be a name; set data.{key}=... ")
        splits, source = _load(path, name)
        if None in splits:  # one file or one saved Dataset: it is the split to train on, whatever its name
            train_set, test_set = splits[None], None
        elif split not in splits:
            raise ConfigError(f"data.split ({split!r}) is not a split of {source} (it has {', '.join(splits)}); "
                              f"set data.split={next(iter(splits))}")
        else:
            train_set = splits[split]
            test_set = splits.get(test_split) if test_split and test_split != split else None
        self.path, self.name, self.split, self.test_split, self.limit = path, name, split, test_split, limit
        self.prompt_field = prompt_field
        self.source = source if test_set is None else f"{source} [{split}]"
        self.conversational, prompts = self._check(train_set, source)
        test_prompts = None
        if test_set is not None:
            test_conversational, test_prompts = self._check(test_set, f"{source} [{test_split}]")
            if test_conversational != self.conversational:
                raise DataError(f"{source}: the prompts of split {test_split!r} and of {split!r} are in different "
                                f"formats (a string in one, messages in the other); make them the same")
        self.columns = [c for c in train_set.column_names if c != prompt_field]
        train_ids, held_ids = self._split(prompts, test_prompts, source)
        test_set = train_set if test_set is None else test_set
        if limit is not None:
            train_ids = train_ids[:limit]
        # (where, the prompt as given) of every training then held-out row, for prompt_rows
        held_source, held_prompts = ((self.source, prompts) if test_prompts is None
                                     else (f"{source} [{test_split}]", test_prompts))
        self._prompts = ([(f"{self.source} row {i + 1}", prompts[i]) for i in train_ids]
                         + [(f"{held_source} row {i + 1}", held_prompts[i]) for i in held_ids])
        self.train: Sequence[Example] = _Generated(len(train_ids), lambda k: self._row(train_set, train_ids[k]))
        self.heldout: Sequence[Example] = _Generated(len(held_ids), lambda k: self._row(test_set, held_ids[k]))

    def _split(self, prompts: list, test_prompts: list | None, source: str) -> tuple[list[int], list[int]]:
        """(training row ids, held-out row ids): the test split's rows, or a seeded slice of `prompts`
        (data.heldout_size); a training row whose prompt is held out is dropped. A DataError when none is left."""
        if test_prompts is None:
            order = list(range(len(prompts)))
            random.Random(self.seed).shuffle(order)
            distinct = len({_prompt_key(p) for p in prompts})
            held_ids = sorted(order[:self._heldout_count(len(prompts), distinct, source)])
            held_keys = {_prompt_key(prompts[i]) for i in held_ids}
        else:
            held_ids = list(range(len(test_prompts)))
            held_keys = {_prompt_key(p) for p in test_prompts}
        taken = set(held_ids) if test_prompts is None else set()
        train_ids = [i for i, p in enumerate(prompts) if i not in taken and _prompt_key(p) not in held_keys]
        if train_ids:
            return train_ids, held_ids
        distinct = len({_prompt_key(p) for p in prompts})
        if test_prompts is not None:
            fix = f"its prompts are all in split {self.test_split!r}; set data.test_split=null to hold out a slice"
        elif distinct == 1:  # no held-out size helps: the held-out row's prompt is every row's
            raise DataError(f"{source}: all {len(prompts)} rows have the same prompt (whitespace and case aside), so "
                            f"none is left to train on once one is held out; add rows with other prompts")
        else:  # h held-out rows hold at most h prompts: distinct - 1 leaves one to train on, whichever rows
            fix = f"set data.heldout_size={distinct - 1} ({distinct} distinct prompts) or lower"
        raise DataError(f"{source} has no training rows left after holding out {len(held_ids)} ({len(prompts)} "
                        f"rows, repeated prompts count once); {fix}")

    def _check(self, dataset, source: str) -> tuple[bool, list]:
        """(whether the prompts are messages, else strings; every row's prompt): every row read once, a DataError
        naming the first row with a missing, mistyped or undecodable prompt, or a column named like ours."""
        field, columns = self.prompt_field, dataset.column_names
        if field not in columns:
            raise DataError(f"{source} has no column {field!r} (its columns: {', '.join(columns)}); set "
                            f"data.prompt_field=... to the column holding the prompt")
        if len(dataset) == 0:
            raise DataError(f"{source} has no rows; set data.path=... to a dataset with prompts")
        missing = dataset.data.column(field).null_count
        if missing:
            raise DataError(f"{source}: {missing} rows have no {field!r} (null); remove them or fill them in")
        prompts = _decoded(dataset, field, source)
        for column in columns:  # every other column reaches the reward functions
            if column != field:
                _check_utf8(dataset, column, source)
        first = prompts[0]
        if not isinstance(first, str) and not _is_messages(first):
            raise DataError(f"{source}: column {field!r} holds {type(first).__name__} values ({str(first)[:80]!r}), "
                            f"not a string or a list of {{\"role\", \"content\"}} messages; set "
                            f"data.prompt_field=... to the prompt column (columns: {', '.join(columns)})")
        clash = [c for c in columns if c != field and c in RESERVED]
        if clash:
            raise DataError(f"{source}: column {clash[0]!r} has a name grpo uses for the prompt or the reward "
                            f"call ({', '.join(RESERVED)}); rename it (or make it the prompt: "
                            f"data.prompt_field={clash[0]})")
        conversational = not isinstance(first, str)
        # a column of mixed types reaches here as JSON values (datasets' Json feature): any row may differ
        for n, prompt in enumerate(prompts, 1):
            if (_is_messages(prompt) if conversational else isinstance(prompt, str)):
                continue
            like = "a list of {\"role\", \"content\"} messages" if conversational else "a string"
            raise DataError(f"{source} row {n}: {field!r} holds {type(prompt).__name__} ({repr(prompt)[:80]}), "
                            f"not {like} like row 1's; fix or remove that row")
        return conversational, prompts

    def prompt_rows(self) -> list[tuple[str, list[dict]]]:
        return [(where, self._chat(prompt)[0]) for where, prompt in self._prompts]

    def _chat(self, prompt) -> tuple[list[dict], str]:
        """(chat messages, the question's text) of a prompt as the dataset gives it."""
        if self.conversational:  # every row's prompt is messages: checked when the task was built (_check)
            # Arrow gives every message every key of any message (None where absent): keep the ones it has
            messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
            users = [m["content"] for m in messages if m["role"] == "user"]
            return messages, str(users[-1] if users else messages[-1]["content"])
        return self._messages(prompt), prompt

    def _row(self, dataset, index: int) -> Example:
        row = dict(dataset[index])
        prompt = row.pop(self.prompt_field)
        messages, question = self._chat(prompt)
        return {"messages": messages, "question": question, "prompt": prompt, **row}

    def __repr__(self) -> str:
        kind = "conversational" if self.conversational else "standard"
        return f"HFTask({self.source}, {kind}, train={len(self.train)}, heldout={len(self.heldout)})"
