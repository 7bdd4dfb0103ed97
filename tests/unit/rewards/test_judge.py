"""The judge reward (grpo_cli/rewards/judge.py) against a real HTTP server on localhost: scores, a timeout, a 500,
malformed JSON, a slow server, the concurrency bound and the key's header; a redirect, a trickle and a flood (the
key stays on its host, the deadline and the size cap hold); its config checks."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest
from omegaconf import OmegaConf

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards.judge import judge as judge_fn
from grpo_cli.rewards.judge import parse_score
from tests.helpers import REPO
from tests.helpers.judge import JudgeServer, LocalServer, chat_reply

PROMPTS = ["2+2?", "3+3?", "4+4?"]
COMPLETIONS = ["4", "7", "8"]


def judge(server: JudgeServer, **options):
    """reward=judge as conf/reward/judge.yaml builds it, pointed at `server`; returns the judge's scores."""
    section = OmegaConf.load(CONF_DIR / "reward" / "judge.yaml")
    section.functions.judge.base_url = server.url
    section.functions.judge.model = "judge-model"
    for key, value in options.items():
        section.functions.judge[key] = value
    reward = build(section)
    result = reward(PROMPTS, COMPLETIONS, {"answer": ["4", "6", "8"]})
    return result.per_function["judge"]


def test_scores_are_the_last_number_mapped_to_0_1():
    # on the default 0-10 scale: "Score: 8" -> (8 - 0) / (10 - 0) = 0.8; "2/10" is 2 out of 10 -> 0.2 (a number
    # written N/M counts as N); "Step 1 ... 10" -> the last number, 10 -> 1.0
    replies = {"4": "Correct. Score: 8", "7": "wrong, 2/10", "8": "Step 1 checks out. 10"}

    def reply(n, body):
        text = body["messages"][-1]["content"]
        completion = text.split("Completion: ")[1].split("\n")[0]
        return 200, chat_reply(replies[completion]), 0.0

    with JudgeServer(reply) as server:
        scores = judge(server, template="Q: {prompt}\nCompletion: {completion}\nReference: {answer}\n")
    assert scores == pytest.approx([0.8, 0.2, 1.0])
    # the template got each example's prompt, completion and answer; the model and the path are OpenAI's
    first = next(r for r in server.requests if "Completion: 4\n" in r["body"]["messages"][-1]["content"])
    assert first["body"]["messages"][-1]["content"] == "Q: 2+2?\nCompletion: 4\nReference: 4\n"
    assert first["body"]["model"] == "judge-model" and first["path"] == "/v1/chat/completions"


def test_a_number_outside_the_range_or_none_at_all_gives_no_score():
    replies = iter(["Score: 11", "I cannot say", "Score: -1"])

    with JudgeServer(lambda n, body: (200, chat_reply(next(replies)), 0.0)) as server:
        scores = judge(server, max_concurrency=1)
    assert scores == [None, None, None]


@pytest.mark.parametrize("reply, low, high, expected", [
    ("Score: 1e1", 0, 10, 1.0),             # 1e1 is ten: (10 - 0) / 10 = 1.0, never the "1" before the e (0.1)
    ("Score: 1.5e-3", 0, 10, 0.00015),      # 0.0015 / 10
    ("Score: 2E+0", 0, 10, 0.2),            # 2 / 10
    ("Score: 1e3", 0, 10, None),            # 1000, outside the scale
    ("Score: -2", -5, 5, 0.3),              # (-2 - -5) / (5 - -5) = 3 / 10
    ("Score: -2", 0, 10, None),             # below the scale
    ("Score: 7/10", 0, 10, 0.7),            # N/M counts N
    ("Score: 8.", 0, 10, 0.8),              # the full stop ends the sentence: 8
    ("Score: .5", 0, 10, 0.05),             # .5 is a half: 0.5 / 10, never 5
    ("Score: 6-7", 0, 10, 0.7),             # a dash between two numbers is no minus sign: the last is 7
    ("Score: 3e", 0, 10, 0.3),              # an e with no digits after it is a letter: 3
])
def test_a_score_is_the_whole_last_number(reply, low, high, expected):
    score = parse_score(reply, low, high)
    assert score == (None if expected is None else pytest.approx(expected))


def test_a_timeout_gives_no_score_after_its_retries():
    # each request takes 2 s, the client waits 0.3 s: 1 try + 1 retry per completion, then None
    with JudgeServer(lambda n, body: (200, chat_reply("9"), 2.0)) as server:
        scores = judge(server, timeout_s=0.3, retries=1)
    assert scores == [None, None, None] and len(server.requests) == 6


def test_a_500_is_retried_then_gives_no_score():
    with JudgeServer(lambda n, body: (500, '{"error": "boom"}', 0.0)) as server:
        scores = judge(server, retries=2)
    assert scores == [None, None, None] and len(server.requests) == 9      # 3 tries each


def test_malformed_json_gives_no_score_without_a_retry():
    with JudgeServer(lambda n, body: (200, '{"choices": [', 0.0)) as server:
        scores = judge(server, retries=2)
    assert scores == [None, None, None] and len(server.requests) == 3


def test_a_slow_server_is_retried_then_scores():
    # the first request of each completion is slower than the client's timeout; the retry answers at once
    seen: dict[str, int] = {}

    def reply(n, body):
        text = body["messages"][-1]["content"]
        seen[text] = seen.get(text, 0) + 1
        return 200, chat_reply("Score: 5"), (6.0 if seen[text] == 1 else 0.0)

    # a timeout with room for a loaded machine to answer the retry in time
    with JudgeServer(reply) as server:
        scores = judge(server, timeout_s=2.0, retries=1)
    assert scores == pytest.approx([0.5, 0.5, 0.5]) and len(server.requests) == 6


def test_requests_run_concurrently_up_to_max_concurrency():
    with JudgeServer(lambda n, body: (200, chat_reply("10"), 1.0)) as server:
        judge(server, max_concurrency=2)
    assert server.max_in_flight == 2


def test_the_key_comes_from_the_environment_in_the_authorization_header(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-local-123")
    with JudgeServer(lambda n, body: (200, chat_reply("10"), 0.0)) as server:
        judge(server, api_key_env="JUDGE_TEST_KEY")
    assert {r["authorization"] for r in server.requests} == {"Bearer sk-local-123"}
    with JudgeServer(lambda n, body: (200, chat_reply("10"), 0.0)) as server:
        judge(server)                                   # api_key_env null: a local server, no header
    assert {r["authorization"] for r in server.requests} == {None}


class RawServer(LocalServer):
    """An HTTP server on 127.0.0.1 (http.server in a thread) whose `handle(handler, server)` writes each reply itself:
    a redirect, a trickle, a flood. Every request's method and headers are kept in `seen`; `stop` is set on exit so
    a reply still being written ends with the test."""

    def __init__(self, handle):
        server = self
        self.seen: list[dict] = []
        self.stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                server.seen.append({"method": self.command, "headers": dict(self.headers)})
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    handle(self, server)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up: what the tests below want of it

            do_GET = do_POST  # noqa: N815 (a 301/302/303 turns urllib's POST into a GET)

            def log_message(self, *args):
                pass

        super().__init__(Handler)

    def __exit__(self, *exc):
        self.stop.set()
        super().__exit__(*exc)


def answer(handler, status: int, text: str, **headers: str) -> None:
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", "Content-Length": str(len(text)), **headers}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(text.encode())


# the judge function itself, one completion, on the 0-10 scale (no reward guard around it: the timings are its own)
OPTIONS = dict(model="m", template="{completion}", api_key_env=None, max_concurrency=1, timeout_s=30, retries=0,
               min_score=0, max_score=10, temperature=0.0, max_tokens=8)


def ask(url: str, **options) -> float | None:
    return judge_fn(["q"], ["c"], base_url=url, **{**OPTIONS, **options})[0]


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_so_the_key_never_reaches_another_host(code, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-local-123")
    with RawServer(lambda handler, server: answer(handler, 200, chat_reply("10"))) as other:
        target = other.url + "/chat/completions"                    # another port on 127.0.0.1: another origin
        with RawServer(lambda handler, server: answer(handler, code, "", Location=target)) as endpoint, \
                caplog.at_level(logging.WARNING, logger="grpo_cli.rewards.judge"):
            score = ask(endpoint.url, api_key_env="JUDGE_TEST_KEY", retries=2)
    assert [seen["headers"].get("Authorization") for seen in other.seen] == [None] * len(other.seen)
    assert other.seen == [] and score is None                      # not followed at all: no score
    assert [seen["headers"]["Authorization"] for seen in endpoint.seen] == ["Bearer sk-local-123"]   # no retry
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and f"HTTP {code}" in lines[0] and target in lines[0], lines


@pytest.mark.parametrize("part", ["head", "body"])
def test_a_reply_of_one_byte_a_second_is_cut_at_the_deadline(part):
    # each byte comes within the 2 s between two reads, so only a deadline on the whole request cuts it; the server
    # gives up after 12 bytes (12 s) so that a client without one still ends
    text = chat_reply("10").encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(text)}\r\n\r\n".encode()

    def trickle(handler, server):
        if part == "body":
            handler.wfile.write(head)
        for byte in (text if part == "body" else head + text)[:12]:
            handler.wfile.write(bytes([byte]))
            if server.stop.wait(1.0):
                return

    with RawServer(trickle) as server:
        start = time.monotonic()
        score = ask(server.url, timeout_s=2)
        took = time.monotonic() - start
    assert score is None and took < 2 + 1.5, took


# the judge asked in a fresh process: its peak RSS (ru_maxrss, KiB on Linux) before the call is its own, not the
# test process's high-water mark from earlier tests; judge.py is loaded alone (its package imports torch: seconds)
MEASURE = """
import importlib.util, json, resource, sys
spec = importlib.util.spec_from_file_location("judge", "grpo_cli/rewards/judge.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
judge = module.judge
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
score = judge(["q"], ["c"], base_url=sys.argv[1], **json.loads(sys.argv[2]))[0]
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"score": score, "grew_mb": grew / 1024}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is KiB on Linux")
def test_a_600_mb_reply_is_cut_at_the_cap_and_never_held(tmp_path):
    size, chunk = 600 * 2**20, b" " * 2**16

    def flood(handler, server):                                   # 600 MB announced and streamed, 64 KiB at a time
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        for _ in range(size // len(chunk)):
            if server.stop.is_set():
                return
            handler.wfile.write(chunk)

    with RawServer(flood) as server:
        done = subprocess.run([sys.executable, "-c", MEASURE, server.url, json.dumps(OPTIONS)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["score"] is None and result["grew_mb"] < 50, result
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "1 MiB" in lines[0], lines          # one line says the reply was cut


def errors(*overrides: str) -> list[str]:
    try:
        validate(compose("train", ["reward=judge", "reward.functions.judge.model=m", *overrides]))
    except ConfigError as err:
        return str(err).splitlines()
    return []


def test_judge_composes():
    assert errors() == []


@pytest.mark.parametrize("overrides, line", [
    (["reward.functions.judge.api_key_env=NO_SUCH_JUDGE_KEY"],
     "reward.functions.judge.api_key_env names NO_SUCH_JUDGE_KEY, which is not set: export NO_SUCH_JUDGE_KEY=<key> "
     "(the key is read from the environment only), or set reward.functions.judge.api_key_env=null for a server "
     "without one"),
    (["reward.functions.judge.template='rate {completion} of {question}'"],
     "reward.functions.judge.template has the placeholder {question}: use {prompt}, {completion} and {answer} "
     "(a literal brace is {{ or }})"),
    (["reward.functions.judge.max_concurrency=0"],
     "reward.functions.judge.max_concurrency (0) must be an integer >= 1; "
     "set reward.functions.judge.max_concurrency=8"),
    (["reward.functions.judge.base_url=localhost:8000"],
     "reward.functions.judge.base_url (localhost:8000) must start with http:// or https://; "
     "set reward.functions.judge.base_url=http://localhost:8000/v1"),
])
def test_judge_settings_that_cannot_work_are_refused(overrides, line):
    assert errors(*overrides) == [line]
