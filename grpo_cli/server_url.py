"""Whether a vLLM server answers at a URL: the one check `sampler=vllm_server` makes before anything loads. A leaf
module (standard library only), so the command line can ask before it imports torch (cli.py) and the config check
asks the same way (rollout/vllm_server.py)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

# what an unreachable server's error line suggests
START = "grpo serve (with this run's model overrides; grpo serve --print shows vLLM's own command line)"


def problem(url: str, timeout: float = 5.0) -> str | None:
    """The one error line when no vLLM server answers `url`/v1/models within `timeout` seconds, else None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"sampler.url ({url!r}) must be the server's http://HOST:PORT; set sampler.url=http://127.0.0.1:8000"
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as answer:
            answer.read()
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"sampler=vllm_server: no vLLM server answers at {url} ({getattr(err, 'reason', err)}); start one " \
               f"with: {START}"
    return None


def early(argv: list[str]) -> str | None:
    """The problem with the server a command line names itself (`sampler=vllm_server sampler.url=URL`, no resume=),
    found before the command's imports (~10 s on a small CPU); None when it names none or the server answers. A URL
    from a recipe or the YAML is checked by config validation, after the imports."""
    if "sampler=vllm_server" not in argv or any(a.startswith("resume=") for a in argv):
        return None
    urls = [a.split("=", 1)[1] for a in argv if a.startswith("sampler.url=")]
    return problem(urls[-1]) if urls else None
