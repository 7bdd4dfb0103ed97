"""Atomic writes, one way for every file the project writes (checkpoints, logs, eval results, exports,
reward models, the embedded model's cache).

The one fsync rule: every file is flushed to disk before the rename that makes it visible, and the
folder that holds it after, so a crash or a kill -9 leaves either the old version or the new one,
never half of one. A folder that already exists is renamed aside first and deleted only after the
new one is in place (rename, then delete): at every moment one whole version is on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import yaml  # OmegaConf's YAML library, a dependency already: checked_yaml's event stream


def io_error(err: BaseException) -> bool:
    """An error of the file system (a full disk, a read-only folder): an OSError, or one that a library
    wraps in its own type (safetensors: "I/O error: No space left on device (os error 28)")."""
    return isinstance(err, OSError) or "(os error " in str(err)


def fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    # the process id keeps two processes writing the same target apart
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (a temporary file in the same folder, fsynced, renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)
    return path


@contextlib.contextmanager
def folder(final: str | Path) -> Iterator[Path]:
    """`with files.folder(FINAL) as tmp:` write into `tmp`; on leaving, FINAL holds exactly what was written.

    On an exception (a full disk, Ctrl-C, a failed rename) the temporary folder is removed and FINAL is
    as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.rglob("*"):  # on disk before the rename makes the folder visible
            if file.is_file():
                fsync(file)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f"{final.name}.old{os.getpid()}")
    if final.exists():
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:  # the old version goes back under its name; the new one is dropped
        if old.exists() and not final.exists():
            old.rename(final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)  # only now that the new version is in place


@contextlib.contextmanager
def lock(path: str | Path) -> Iterator[None]:
    """`with files.lock(PATH):` one process at a time on this machine (an exclusive `flock` of PATH, made if
    missing): torchrun's ranks that would fill the same cache at once take turns, and the later ones find it
    filled. The lock goes with the process, so a killed holder leaves none behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- files read back from a run folder: data someone else may have written --------------------------------------

def read_small(path: str | Path, max_bytes: int, *, links: bool = True) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes`: ValueError (one line) for anything else, checked on
    the open file, so a FIFO never blocks the read and /dev/zero is never read to the end. `links=False` does not
    follow a link (OSError ELOOP). FileNotFoundError as open() raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if links else os.O_NOFOLLOW))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("it is not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"it is larger than {max_bytes:,} bytes")
    return data


# the most bytes and YAML nodes (scalars, lists, maps) a run's config.yaml may hold: a saved config has about a
# thousand nodes; the bound stops a file that would take minutes and gigabytes to build
YAML_MAX_BYTES = 8 * 2**20
YAML_MAX_NODES = 100_000


def checked_yaml(path: str | Path) -> str:
    """The text of the YAML file `path`, refused (ValueError, one line) before any of it is built when it is not a
    regular file, is over YAML_MAX_BYTES, has over YAML_MAX_NODES nodes or holds an alias (`*name`): OmegaConf
    expands every alias into a copy, so ten nested lists of ten aliases are 10^10 nodes from a few hundred bytes.
    grpo train writes no aliases (OmegaConf.save writes each node out), so an alias was written by someone else."""
    return check_yaml_text(read_small(path, YAML_MAX_BYTES).decode(errors="replace"))


def check_yaml_text(text: str) -> str:
    """`text`, refused as checked_yaml refuses a file's (over YAML_MAX_NODES nodes, an alias), for a caller that read
    the file itself (read_small)."""
    nodes = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events stream: nothing is built or expanded
        if isinstance(event, yaml.AliasEvent):
            raise ValueError(f"it holds a YAML alias (*{event.anchor}), which grpo train never writes; each one "
                             f"would be expanded into a copy")
        nodes += isinstance(event, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if nodes > YAML_MAX_NODES:
            raise ValueError(f"it holds over {YAML_MAX_NODES:,} YAML nodes, far more than a saved config")
    return text
