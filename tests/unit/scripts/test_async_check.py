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
    (line,) = [json.loads(x) for x in (tmp_path / "results" / "restarts.jsonl").read_text().splitlines()]
    assert (line["run"], line["last_step"]) == ("k0_seed0", 11) and line["why"].startswith("grpo train failed (1)")
    assert server.proc == "server2"


def test_restarts_are_bounded(fake, tmp_path):
    calls, fails, _ = fake
    fails["left"] = async_check.RESTARTS + 1
    server = async_check.Server("http://127.0.0.1:9", tmp_path)
    with pytest.raises(SystemExit):
        server.train(tmp_path / "k1_seed0", ["trainer.max_steps=40"])
    assert [c[0] for c in calls].count("train") == async_check.RESTARTS + 1
    assert len((tmp_path / "results" / "restarts.jsonl").read_text().splitlines()) == async_check.RESTARTS


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


def _finished_run(run, questions, correct, staleness):
    """A run folder as `grpo train` leaves it: metrics.jsonl to step 40 and the eval rows of steps 10-40."""
    (run / "evals").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "sampler/staleness": staleness if s > 1 else 0, "time/step_s": 10.0}) + "\n"
        for s in range(1, 41)))
    for step in async_check.EVALS:
        (run / "evals" / f"step_{step:06d}.jsonl").write_text("".join(
            json.dumps({"question": q, "correct": c, "greedy": {"answer": "7" if c else "8"}}) + "\n"
            for q, c in zip(questions, correct)))


def test_a_finished_run_leaves_a_result_that_outlives_its_folder(monkeypatch, tmp_path, capsys):
    """A new session starts on a fresh machine: the report and the skip read OUT/results/RUN.json only, so the run
    folders (weights, logs) may be gone."""
    import shutil

    trained = []
    monkeypatch.setattr(async_check, "train_or_resume", lambda run, args, prefix=(): trained.append(run.name))
    questions = [f"q{i}" for i in range(4)]
    _finished_run(tmp_path / "k0_seed0", questions, [True, False, False, True], 0)
    _finished_run(tmp_path / "k1_seed0", questions, [True, True, False, True], 1)
    for k in (0, 1):
        async_check.train(tmp_path / f"k{k}_seed0", ["trainer.max_steps=40"])
        shutil.rmtree(tmp_path / f"k{k}_seed0")
        async_check.train(tmp_path / f"k{k}_seed0", ["trainer.max_steps=40"])  # skipped: its result is there
    assert trained == []  # both were done: no grpo train, a result each
    saved = async_check.result(tmp_path, "k1_seed0")
    assert saved["evals"]["40"]["correct"] == [True, True, False, True]
    assert saved["evals"]["40"]["answer"] == ["7", "7", "8", "7"]
    capsys.readouterr()
    monkeypatch.setattr("sys.argv", ["async_check.py", "report", str(tmp_path)])
    async_check.main()  # the report, printed and kept in OUT/report.md for git
    out = capsys.readouterr().out
    assert (tmp_path / "report.md").read_text() == out
    # one seed, problem 2 flips to right: mean paired difference 1/4
    assert "| 40 | 0.500 | 0.750 | +0.250 |" in out
    assert "K=1: sampler/staleness max 1, steps at 1: 39 of 40" in out


def test_a_run_without_its_result_trains_and_then_writes_it(monkeypatch, tmp_path):
    def train_or_resume(run, args, prefix=()):
        _finished_run(run, ["q0"], [True], 0)

    monkeypatch.setattr(async_check, "train_or_resume", train_or_resume)
    async_check.train(tmp_path / "k0_seed3", ["trainer.max_steps=40"])
    assert async_check.result(tmp_path, "k0_seed3")["evals"]["40"]["correct"] == [True]
