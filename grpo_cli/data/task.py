"""What every task shares: the example record, prompt settings -> chat messages, on-demand sequences."""

from __future__ import annotations

import operator
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_cli.errors import ConfigError
from grpo_cli.metrics.console import console

Example = dict[str, Any]

# data.heldout_size=auto, a file's seeded held-out slice: a tenth of its rows, at least 1 and at most AUTO_MOST. Every
# dataset of 2,000 rows or more holds out AUTO_MOST, the number these tasks held out before auto existed (GSM8K's
# 7,473 rows: the same 200 rows, so its runs' held-out numbers stay comparable)
AUTO_SHARE, AUTO_MOST = 10, 200


def _check_int(name: str, value: Any, minimum: int, fix: Any, *, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        null = " or null" if nullable else ""
        raise ConfigError(f"data.{name} ({value!r}) must be an integer >= {minimum}{null}; set data.{name}={fix}")


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _special(mode: int) -> str | None:
    """What a file that is neither a regular file nor a folder is, for an error line; None for those two."""
    return next((kind for test, kind in _KINDS if test(mode)), None if stat.S_ISREG(mode) or stat.S_ISDIR(mode)
                else "not a regular file")


def _named(path: Path) -> str:
    return f"{path} (a link to {path.resolve()})" if path.is_symlink() else str(path)


def check_regular(root: Path) -> None:
    """A ConfigError unless `root` (data.path, existing) is a regular file or a folder whose files are all regular,
    links followed: before anything is opened, since a FIFO with no writer blocks its reader forever and a device
    such as /dev/zero never ends."""
    why = "not a regular file: reading one can block forever or never end"
    kind = _special(root.stat().st_mode)
    if kind is not None:
        link = f"a link to {root.resolve()}, " if root.is_symlink() else ""
        raise ConfigError(f"data.path ({root}) is {link}{kind}, {why}; set data.path=... to a .jsonl/.parquet file or "
                          f"a folder of them")
    if not root.is_dir():
        return
    seen, folders = set(), [root]  # each folder once by (device, inode): a link back up is no endless walk
    while folders:
        folder = folders.pop()
        try:
            info = folder.stat()
            entries = sorted(folder.iterdir())
        except OSError:  # a folder that cannot be listed: the reader says so when it gets there
            continue
        if (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))
        for entry in entries:
            try:
                mode = entry.stat().st_mode
            except OSError:  # a link to nothing: no reader can block on it, and `datasets` names it if it matters
                continue
            if stat.S_ISDIR(mode):
                folders.append(entry)
            elif (kind := _special(mode)) is not None:
                raise ConfigError(f"data.path ({root}) holds {_named(entry)}, {kind}, {why}; remove it, or set "
                                  f"data.path=... to a folder of regular files")


def _read_template(path: str | None) -> str | None:
    """The text of the .jinja file data.chat_template names; None for the tokenizer's own template."""
    if path is None:
        return None
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(f"data.chat_template ({path}) is not a file: give the path of a .jinja chat template, or "
                          f"set data.chat_template=null for the tokenizer's own")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"data.chat_template ({path}) cannot be read ({err}); give a readable UTF-8 file") from None


class _Task:
    """Prompt settings shared by every task, and the chat messages they produce."""

    train: Sequence[Example]
    heldout: Sequence[Example]

    def __init__(self, *, seed: int, heldout_size: int | str, system_prompt: str | None, instruction: str,
                 few_shot: int, chat_template: str | None, chat_template_kwargs: dict | None) -> None:
        _check_int("seed", seed, 0, 0)
        if heldout_size != "auto" and (not isinstance(heldout_size, int) or isinstance(heldout_size, bool)
                                       or heldout_size < 1):
            raise ConfigError(f"data.heldout_size ({heldout_size!r}) must be an integer >= 1 or auto; "
                              f"set data.heldout_size=auto")
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
        # the text of data.chat_template (read now: a missing file stops the run before the model loads) and the
        # variables of data.chat_template_kwargs; `rollout.use_chat_template` hands both to a tokenizer
        self.chat_template = _read_template(chat_template)
        if not (chat_template_kwargs is None or isinstance(chat_template_kwargs, Mapping)):
            raise ConfigError(f"data.chat_template_kwargs ({chat_template_kwargs!r}) must be a mapping, e.g. "
                              f"'+data.chat_template_kwargs.enable_thinking=false'; "
                              f"set data.chat_template_kwargs={{}}")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # (question, assistant reply) pairs, the same earlier turns in every prompt
        self.shots: list[tuple[str, str]] = []

    def prompt_rows(self) -> list[tuple[str, list[dict]]]:
        """(where, chat messages) of every prompt read from a user's data, training rows then held-out ones, for
        grpo_cli.lengths; none for a generated task, whose settings bound its prompts."""
        return []

    def _heldout_count(self, rows: int, distinct: int, source: str) -> int:
        """data.heldout_size as a number of the `rows` (`distinct` questions): the number given, or for auto a tenth
        (AUTO_SHARE), never so many that no question is left to train on; said in one line when under AUTO_MOST."""
        if self.heldout_size != "auto":
            return self.heldout_size
        # h held-out rows and f shots hold at most h + f questions: h <= distinct - f - 1 leaves one to train on
        count = max(1, min(AUTO_MOST, rows // AUTO_SHARE, distinct - self.few_shot - 1))
        if count < AUTO_MOST:
            console.print(f"data: {count} of {source}'s {rows} rows held out for eval (data.heldout_size=auto: a "
                          f"tenth, at least 1, at most {AUTO_MOST}); set data.heldout_size=N for another number",
                          markup=False, highlight=False, soft_wrap=True)
        return count

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

