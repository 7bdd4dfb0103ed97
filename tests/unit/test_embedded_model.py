"""The embedded model's cache, filled by several ranks at once: one converts under the lock, the others read.

Light imports on purpose: the spawned children import this module, and torch would cost each seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _convert_slowly(target_dir: str, log: str) -> None:
    """A stand-in conversion in a child process: logs its start and end under the cache's lock."""
    import time

    from grpo_cli import files

    target = Path(target_dir)
    with files.lock(target.with_name(target.name + ".lock")):
        with open(log, "a") as out:
            out.write(f"start {os.getpid()} {time.monotonic()} {(target / 'done').exists()}\n")
        if not (target / "done").exists():
            time.sleep(0.5)
            with files.folder(target) as tmp:
                (tmp / "done").write_text("x")
        with open(log, "a") as out:
            out.write(f"end {os.getpid()} {time.monotonic()}\n")


def test_cache_lock_lets_one_rank_convert_and_the_others_read(tmp_path):
    import multiprocessing

    log = tmp_path / "log.txt"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_convert_slowly, args=(str(tmp_path / "cache" / "model"), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    events = [line.split() for line in log.read_text().splitlines()]
    # under the lock: start, end, start, end, ... (never two starts in a row), and only the first converts
    assert [e[0] for e in events] == ["start", "end"] * 3
    assert [e[3] for e in events if e[0] == "start"] == ["False", "True", "True"]


@pytest.mark.slow  # converts the GGUF afresh (~20 s)
def test_embedded_model_conversion_holds_the_cache_lock(tmp_path, monkeypatch):
    from grpo_cli import policy

    held = []
    real_lock = policy.files.lock

    def watching(path):
        held.append(Path(path).name)
        return real_lock(path)

    monkeypatch.setattr(policy.files, "lock", watching)
    model, _ = policy.load_embedded_gguf(cache_dir=str(tmp_path))
    assert len(held) == 1 and held[0].endswith(".lock") and any(tmp_path.glob("*/model.safetensors"))
