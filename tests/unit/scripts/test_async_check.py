"""scripts/async_check.py's server restarts: a run that stops because the server stopped answering is resumed after
the server is started again, each restart recorded, and only so many times (the runs themselves are the real
model's, through a real server)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script

async_check = load_script("async_check")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """start/stop/train replaced: `calls` records them, `runs` each run's arguments; train fails as many times as
    `fails` says."""
    calls, fails, runs = [], {"left": 0}, {}

    def start(url, log, prefix=(), overrides=()):
        calls.append(("start", url, prefix, overrides))
        return f"server{len([c for c in calls if c[0] == 'start'])}"

    def train(run, args, prefix=()):
        calls.append(("train", run.name))
        runs[run.name] = (prefix, args)
        if fails["left"]:
            fails["left"] -= 1
            (run / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
            (run / "metrics.jsonl").write_text(json.dumps({"step": 11}) + "\n")
            raise SystemExit(f"grpo train failed (1): {run}.log")

    monkeypatch.setattr(async_check, "start", start)
    monkeypatch.setattr(async_check, "stop", lambda proc: calls.append(("stop", proc)))
    monkeypatch.setattr(async_check, "train", train)
    return calls, fails, runs


def test_a_run_stopped_by_the_server_resumes_after_a_restart(fake, tmp_path):
    calls, fails, _ = fake
    fails["left"] = 1
    server = async_check.Server("http://127.0.0.1:9", tmp_path, prefix=("taskset", "-c", "0"))
    server.train(tmp_path / "k0_seed0", ["trainer.max_steps=40"])
    started = ("start", "http://127.0.0.1:9", ("taskset", "-c", "0"), ("sampler=vllm_server_short",))
    assert calls == [started, ("train", "k0_seed0"), ("stop", "server1"), started, ("train", "k0_seed0")]
    (line,) = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert (line["run"], line["last_step"]) == ("k0_seed0", 11) and line["why"].startswith("grpo train failed (1)")
    assert server.proc == "server2"


def test_restarts_are_bounded(fake, tmp_path):
    calls, fails, _ = fake
    fails["left"] = async_check.RESTARTS + 1
    server = async_check.Server("http://127.0.0.1:9", tmp_path)
    with pytest.raises(SystemExit):
        server.train(tmp_path / "k1_seed0", ["trainer.max_steps=40"])
    assert [c[0] for c in calls].count("train") == async_check.RESTARTS + 1
    assert len((tmp_path / "restarts.jsonl").read_text().splitlines()) == async_check.RESTARTS


@pytest.mark.parametrize("what", ["accuracy", "overlap"])
def test_the_arms_and_the_server_sample_the_default_jobs_length_each_on_its_core(what, fake, tmp_path, monkeypatch):
    """The default job cuts answers at 32 tokens; plain sampler=vllm_server samples 256 (another job: a first K=0 run
    with it had 3x the default job's mean length at step 1). Every arm, and the server, take vllm_server_short."""
    calls, _, runs = fake
    monkeypatch.setattr(async_check, "report_accuracy", lambda out: None)
    monkeypatch.setattr(async_check, "report_overlap", lambda out: None)
    if what == "accuracy":
        async_check.accuracy(tmp_path, [0], 9)
    else:
        async_check.overlap(tmp_path, 6, 9)
    assert {c[2:] for c in calls if c[0] == "start"} == {(("taskset", "-c", "0"), ("sampler=vllm_server_short",))}
    assert len(runs) == (2 if what == "accuracy" else 4)
    for prefix, args in runs.values():  # and the trainer on the other core
        assert prefix == ("taskset", "-c", "1")
        assert [a for a in args if a.startswith("sampler=")] == ["sampler=vllm_server_short"]
