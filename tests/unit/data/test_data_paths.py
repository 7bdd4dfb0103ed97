"""A data.path that is not a regular file (a FIFO, /dev/zero, a socket), or a folder holding one, is one ConfigError
line before anything is read: a FIFO with no writer blocks the reader forever and /dev/zero never ends, so a run
folder holding either held `grpo eval` until it was killed or the machine ran out of memory. A hub id and a link to
a regular file still work.

Each load runs in a forked child with a deadline and a memory cap, so a reader that blocks or reads forever fails
this test as a timeout (or a MemoryError), never hangs the suite or fills the machine's memory."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import socket

import pytest

from grpo_cli.data import load_task

# six problems as each task reads them (data=hf: `question` is a name it keeps for itself)
ROWS = {name: "".join(json.dumps({field: f"q{i}", "answer": str(i)}) + "\n" for i in range(6))
        for name, field in (("hf", "prompt"), ("jsonl", "question"))}
DEADLINE_S = 30
# what the child may map beyond what it already has: /dev/zero read to the end hits this in seconds
HEADROOM = 1 << 30


def _child(out, name: str, path: str) -> None:
    with open("/proc/self/status") as status:  # the child's mapped memory now (torch's libraries: several GB)
        mapped = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        task = load_task(name, path=path, heldout_size=1)
        out.send(("built", type(task).__name__))
    except BaseException as err:  # noqa: BLE001 (whatever it is, the parent asserts on it)
        out.send((type(err).__name__, str(err)))


def load(name: str, path) -> tuple[str, str]:
    """(the error's type name, its message) of load_task(name, path=path), or ("built", the task's class), read in a
    forked child; ("timeout", "") when it did not answer within DEADLINE_S."""
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe(duplex=False)
    child = fork.Process(target=_child, args=(theirs, name, str(path)), daemon=True)
    child.start()
    try:
        return ours.recv() if ours.poll(DEADLINE_S) else ("timeout", "")
    finally:
        child.kill()
        child.join()


@pytest.fixture()
def fifo(tmp_path):
    path = tmp_path / "prompts.jsonl"
    os.mkfifo(path)
    return path


def refused(name: str, path) -> str:
    kind, message = load(name, path)
    assert kind == "ConfigError", (kind, message[:300])
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["hf", "jsonl", "gsm8k"])
def test_a_fifo_is_refused_before_it_is_opened(fifo, name):
    assert refused(name, fifo) == (
        f"data.path ({fifo}) is a named pipe (FIFO), not a regular file: reading one can block forever or never end; "
        f"set data.path=... to a .jsonl/.parquet file or a folder of them")


@pytest.mark.parametrize("name", ["hf", "jsonl"])
def test_dev_zero_is_refused(name):
    assert refused(name, "/dev/zero").startswith("data.path (/dev/zero) is a character device, not a regular file")


def test_a_socket_is_refused(tmp_path):
    path = tmp_path / "s.jsonl"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        assert refused("hf", path).startswith(f"data.path ({path}) is a socket, not a regular file")


@pytest.mark.parametrize("name", ["hf", "jsonl"])
def test_a_folder_holding_a_fifo_is_refused(tmp_path, name):
    os.mkfifo(tmp_path / "train.jsonl")
    assert refused(name, tmp_path) == (
        f"data.path ({tmp_path}) holds {tmp_path / 'train.jsonl'}, a named pipe (FIFO), not a regular file: reading "
        f"one can block forever or never end; remove it, or set data.path=... to a folder of regular files")


@pytest.mark.parametrize("name", ["hf", "jsonl"])
def test_a_link_to_dev_zero_in_a_folder_is_refused(tmp_path, name):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").symlink_to("/dev/zero")
    (tmp_path / "data" / "test.jsonl").write_text(ROWS[name])
    line = refused(name, tmp_path / "data")
    assert line.startswith(f"data.path ({tmp_path / 'data'}) holds {tmp_path / 'data' / 'train.jsonl'} (a link to "
                           f"/dev/zero), a character device, not a regular file"), line


def test_a_link_to_dev_zero_as_the_path_is_refused(tmp_path):
    (tmp_path / "p.jsonl").symlink_to("/dev/zero")
    assert refused("hf", tmp_path / "p.jsonl").startswith(
        f"data.path ({tmp_path / 'p.jsonl'}) is a link to /dev/zero, a character device, not a regular file")


@pytest.mark.parametrize("name, task", [("hf", "HFTask"), ("jsonl", "JsonlTask")])
def test_links_to_regular_files_and_folders_still_load(tmp_path, name, task):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "train.jsonl").write_text(ROWS[name])
    (tmp_path / "p.jsonl").symlink_to(tmp_path / "real" / "train.jsonl")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").symlink_to(tmp_path / "real" / "train.jsonl")
    (tmp_path / "folder" / "up").symlink_to(tmp_path / "real")  # a link to a folder: walked as one
    (tmp_path / "real" / "loop").symlink_to(tmp_path / "folder")  # and a cycle: each folder walked once, not forever
    assert load(name, tmp_path / "p.jsonl") == ("built", task)
    assert load(name, tmp_path / "folder") == ("built", task)


def test_a_hub_id_is_not_a_local_path(monkeypatch):
    # a name that is no local file or folder goes to the hub as before (here: a hub that cannot be reached)
    monkeypatch.setattr("grpo_cli.data.hf._hub_reachable", lambda endpoint: False)
    kind, message = load("hf", "some-org/some-dataset")
    assert kind == "DataError" and message.startswith("some-org/some-dataset is not a local file or folder"), message
