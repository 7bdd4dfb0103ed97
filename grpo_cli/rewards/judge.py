"""A judge reward: a model behind any OpenAI-compatible chat endpoint (a vLLM server, a hosted API) scores each
completion.

`judge(prompts, completions, answer=None, ...)` renders the user's template with {prompt}, {completion} and
{answer} for each completion, POSTs it to `{base_url}/chat/completions` (one user message), and reads the score
from the reply (`parse_score`): the last number in it, read whole (1e1 is 10), where a number written N/M counts as
N; a score in [min_score, max_score] is mapped linearly to [0, 1], anything else (no number, out of range) is no
score.
Requests run on `max_concurrency` threads, each within `timeout_s` in all (connect and every read together,
`_Deadline`: a server that trickles its reply is cut there), and read at most MAX_REPLY_BYTES (1 MiB) of the reply.
A transport error, a timeout, a 429 or a 5xx is retried `retries` times with a doubling pause, and a request that
still fails, or whose reply is not the JSON of a chat completion or passes the cap, gives None ("no score", counted
as `rewards/<name>/no_score`, with one line), never an error of the step.

The key, when the endpoint needs one, is read from the environment variable `api_key_env` names, at each call: the
config and the run folder hold only the variable's name. A redirect is never followed (`_NoRedirect`), so the key
goes to base_url's host only: a 3xx reply is no score, with a line naming where it points. Standard library only
(urllib): no client dependency.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import socket
import string
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from grpo_cli.checks import Check, is_int, is_num

log = logging.getLogger(__name__)

TARGET = "grpo_cli.rewards.judge.judge"
PLACEHOLDERS = ("prompt", "completion", "answer")
# a number as written: digits with an optional fraction (or a bare fraction, .5), an optional exponent (1e1, 2E-3)
_NUMBER = r"(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?"
# a score: a number, signed when its minus follows no letter, digit or point (so the dash of 6-7 is no sign), and
# the "/M" of a score written "N/M" (N counts)
_SCORE = re.compile(rf"((?:(?<![\w.])-)?{_NUMBER})(?:\s*/\s*{_NUMBER})?")
# the first retry's pause; each next one doubles it
_BACKOFF_S = 0.5
# the most bytes of a reply that are read: a chat completion of max_tokens tokens is a few KiB, so a longer reply is
# cut here and gets no score, and a judge that floods cannot grow the trainer's memory
MAX_REPLY_BYTES = 2**20
# the reply is read this much at a time, so the cap holds before the bytes past it are read
_CHUNK_BYTES = 2**16


class _Retry(Exception):
    """A failure worth another try: the server was slow, busy or broken, not the request or its reply."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: urllib would send the request's headers, the key among them, to wherever the
    reply points, another host included. Following one never scored anyway: a 301/302/303 turns the POST into a GET,
    which no chat endpoint answers, and urllib refuses a POST's 307/308. A 3xx is an HTTPError, then no score."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _Deadline:
    """One request's end, connect and every read together: urllib's timeout bounds each read alone, so a server
    that sends a byte a second would hold a request for as long as it kept sending. When the time is up the
    request's sockets are shut, which wakes a read blocked on one (its headers, its body, a TLS handshake); each
    socket is watched through a duplicate of it, since a TLS wrap takes the original's descriptor away. The name
    lookup before the connect is the one step it cannot cut (the resolver takes no timeout)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.passed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._shut)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(self.end - time.monotonic(), 0.0)

    def connect(self, address, timeout, source_address=None) -> socket.socket:
        """socket.create_connection with at most the time left, its socket watched (http.client's hook)."""
        sock = socket.create_connection(address, min(timeout, self.left()), source_address)
        with self._lock:
            self._sockets.append(sock.dup())
        if self.passed:
            self._shut()  # the time ran out while it connected
        return sock

    def _shut(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its end

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def _connections(deadline: _Deadline) -> list[urllib.request.BaseHandler]:
    """urllib's HTTP and HTTPS handlers, whose connections open their sockets through `deadline`."""

    def watched(connection_class):
        def make(*args, **kwargs):
            connection = connection_class(*args, **kwargs)
            connection._create_connection = deadline.connect  # where http.client opens its socket
            return connection
        return make

    class HTTP(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(watched(http.client.HTTPConnection), req)

    class HTTPS(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(watched(http.client.HTTPSConnection), req, context=self._context)

    return [HTTP(), HTTPS()]


def _read(response) -> bytes:
    """The reply's body, read a chunk at a time; ValueError once it passes MAX_REPLY_BYTES."""
    chunks, size = [], 0
    while chunk := response.read(min(_CHUNK_BYTES, MAX_REPLY_BYTES + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ValueError(f"the reply passed {MAX_REPLY_BYTES // 2**20} MiB: cut there, no score")
    return b"".join(chunks)


def parse_score(text: str, min_score: float, max_score: float) -> float | None:
    """The last number of the judge's reply mapped from [min_score, max_score] to [0, 1]; None without one in range.

    A number is read whole, as Python's float reads it: "1e1" is 10 (1.0 on a 0-10 scale, never the 1 before the
    e), "1.5e-3" is 0.0015, ".5" is 0.5 and "8." is 8 (the point ends the sentence). A minus is a sign only where
    no letter, digit or point comes right before it: "-2" is -2 (no score on a 0-10 scale), while "6-7" reads 6 and
    then 7. In "7/10" the 7 counts. A number too large for a float ("1e999") is out of range: no score."""
    found = _SCORE.findall(text or "")
    if not found:
        return None
    score = float(found[-1])
    if not min_score <= score <= max_score:
        return None
    return (score - min_score) / (max_score - min_score)


def _text(prompt) -> str:
    """A prompt as the template gets it: its text, or a conversation's last message's."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return str(prompt)


def _post(url: str, body: bytes, headers: dict, timeout_s: float) -> str:
    """The reply's message content; `_Retry` for what another try may fix, ValueError for a malformed reply."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    deadline = _Deadline(timeout_s)
    late = f"no whole reply within timeout_s={timeout_s:g} s"
    try:
        with urllib.request.build_opener(_NoRedirect, *_connections(deadline)).open(request, timeout=timeout_s) \
                as response:
            raw = _read(response)
    except urllib.error.HTTPError as err:
        err.close()
        if err.code == 429 or err.code >= 500:
            raise _Retry(f"HTTP {err.code}") from err
        if 300 <= err.code < 400:
            raise ValueError(f"HTTP {err.code}: the endpoint redirects to {err.headers.get('Location')}, which is not "
                             f"followed (the key would go along); set base_url to the endpoint itself") from err
        raise ValueError(f"HTTP {err.code}") from err
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, http.client.HTTPException) as err:
        raise _Retry(late if deadline.passed else str(err)) from err
    finally:
        deadline.close()
    if deadline.passed:
        raise _Retry(late)  # the shut socket read as the end of a body sent without its length
    try:
        return json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"not a chat completion: {raw[:200]!r}") from err


def _ask(url: str, body: bytes, headers: dict, timeout_s: float, retries: int) -> str | None:
    """One judge request with its retries; None when it never got a usable reply."""
    for attempt in range(retries + 1):
        try:
            return _post(url, body, headers, timeout_s)
        except _Retry as err:
            if attempt == retries:
                log.warning("judge: no reply after %d tries (%s)", retries + 1, err)
                return None
            time.sleep(_BACKOFF_S * 2 ** attempt)
        except ValueError as err:
            log.warning("judge: %s", err)
            return None
    return None


def judge(prompts, completions, answer=None, *, base_url: str, model: str, template: str, api_key_env: str | None,
          max_concurrency: int, timeout_s: float, retries: int, min_score: float, max_score: float,
          temperature: float, max_tokens: int, **_) -> list[float | None]:
    """A score in [0, 1] per completion from the judge model, or None (see the module docstring)."""
    answers = answer if answer is not None else [None] * len(completions)
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(api_key_env, '')}"
    url = base_url.rstrip("/") + "/chat/completions"

    def score(i: int) -> float | None:
        content = template.format(prompt=_text(prompts[i]), completion=_text(completions[i]),
                                  answer="" if answers[i] is None else answers[i])
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                           "temperature": temperature, "max_tokens": max_tokens}).encode()
        reply = _ask(url, body, headers, timeout_s, retries)
        return None if reply is None else parse_score(reply, min_score, max_score)

    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        return list(pool.map(score, range(len(completions))))


# ---- config checks: every judge among reward.functions, before any model loads ---------------------------------


def _judges(cfg) -> list[tuple[str, object]]:
    reward = cfg.get("reward")
    functions = reward.get("functions") if reward is not None else None
    if not functions or not hasattr(functions, "items"):
        return []
    return [(f"reward.functions.{name}", node) for name, node in functions.items()
            if hasattr(node, "get") and node.get("_target_") == TARGET]


def _check_judge(path: str, node) -> list[str]:
    errors = []
    url = node.get("base_url")
    if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        errors.append(f"{path}.base_url ({url}) must start with http:// or https://; "
                      f"set {path}.base_url=http://localhost:8000/v1")
    if not node.get("model"):
        errors.append(f"{path}.model is not set: name the judge model the endpoint serves, "
                      f"e.g. {path}.model=Qwen/Qwen3-8B")
    template = node.get("template")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template or "") if f is not None]
    except ValueError as err:
        errors.append(f"{path}.template cannot be read ({err}): a literal brace is {{{{ or }}}}")
        fields = []
    for field in fields:
        if field not in PLACEHOLDERS:
            errors.append(f"{path}.template has the placeholder {{{field}}}: use {{prompt}}, {{completion}} and "
                          f"{{answer}} (a literal brace is {{{{ or }}}})")
    if not is_int(node.get("max_concurrency")) or node.get("max_concurrency") < 1:
        errors.append(f"{path}.max_concurrency ({node.get('max_concurrency')}) must be an integer >= 1; "
                      f"set {path}.max_concurrency=8")
    if not is_int(node.get("retries")) or node.get("retries") < 0:
        errors.append(f"{path}.retries ({node.get('retries')}) must be an integer >= 0; set {path}.retries=2")
    if not (is_num(node.get("timeout_s")) and node.get("timeout_s") > 0):
        errors.append(f"{path}.timeout_s ({node.get('timeout_s')}) must be > 0; set {path}.timeout_s=60")
    low, high = node.get("min_score"), node.get("max_score")
    if not (is_num(low) and is_num(high) and math.isfinite(low) and math.isfinite(high) and low < high):
        errors.append(f"{path}.min_score ({low}) must be below {path}.max_score ({high}): the judge's scale; "
                      f"set {path}.min_score=0 {path}.max_score=10")
    key = node.get("api_key_env")
    if key and key not in os.environ:
        errors.append(f"{path}.api_key_env names {key}, which is not set: export {key}=<key> (the key is read from "
                      f"the environment only), or set {path}.api_key_env=null for a server without one")
    return errors


CHECKS: list[Check] = [lambda cfg: [e for path, node in _judges(cfg) for e in _check_judge(path, node)]]
