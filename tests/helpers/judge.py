"""Loopback HTTP servers for the tests of what talks to one (the judge reward, the vLLM server's client, a shared run
folder's doors): `LocalServer`, the judge's OpenAI-compatible `JudgeServer`, and their JSON replies."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    """An HTTP server on 127.0.0.1 (a free port; `url` is its /v1 base) that serves `handler`, a
    BaseHTTPRequestHandler class, in a daemon thread while the `with` block runs: loopback only."""

    def __init__(self, handler):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # serve_forever checks for shutdown() between polls: its default 0.5 s poll made every `with` block end
        # ~0.5 s late (a judge test's server, each planted door's endpoint); 0.05 s ends it in ~0.05 s
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def send_json(handler: BaseHTTPRequestHandler, status: int, text: str) -> None:
    """Answer `handler`'s request with `status` and the JSON `text`; a client that gave up (its timeout) is let go."""
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(text.encode())))
        handler.end_headers()
        handler.wfile.write(text.encode())
    except (BrokenPipeError, ConnectionResetError):
        pass


class JudgeServer(LocalServer):
    """A real OpenAI-compatible chat endpoint on localhost (http.server in a thread) for the judge reward's tests.

    `reply(n, body) -> (status, text, delay_s)` answers the n-th request (0-based); every request's JSON body and
    Authorization header are kept in `requests`, and `max_in_flight` is the most requests it held at once."""

    def __init__(self, reply):
        server = self
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    n = len(server.requests)
                    server.requests.append({"path": self.path, "body": body,
                                            "authorization": self.headers.get("Authorization")})
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                status, text, delay = reply(n, body)
                time.sleep(delay)
                with lock:
                    server.in_flight -= 1
                send_json(self, status, text)

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def chat_reply(content: str) -> str:
    """An OpenAI chat completion's JSON whose one choice says `content`."""
    return json.dumps({"id": "x", "object": "chat.completion",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                    "finish_reason": "stop"}]})

