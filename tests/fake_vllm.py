"""A stand-in for vLLM's OpenAI server on loopback, for the vLLM-server sampler's tests (its client, and torchrun ranks
sharing one server): the endpoints the sampler calls, every request kept."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.judge import LocalServer, send_json


class FakeVLLM(LocalServer):
    """vLLM's endpoints as the sampler uses them. Completions: each choice is `k + 10, EOS` for choice k (ids that
    tell the choices apart), log-prob -0.5 per token; `prompt_logprobs` are the `scorer` policy's own (a server
    with the same weights) or `off` nats away (another model). A full-weight push (`/collective_rpc`
    reload_weights) is read as vLLM's loader reads its folder, into `reloaded`, and into the model the server
    answers with from then on (`served`, the scorer's base copied at the first reload) as vLLM's CPU build takes it:
    its tied LM head holds its own copy of the embeddings, refreshed only by a weight named lm_head.weight
    (`refreshes_head=False`: a server whose reload never refreshes it). `missing`: paths answered 404; `delay`:
    seconds every completion waits."""

    def __init__(self, scorer=None, *, off: float = 0.0, missing=(), delay: float = 0.0, eos: int = 2,
                 refreshes_head: bool = True):
        server = self
        self.requests: list[tuple[str, dict]] = []
        self.reloaded: list[tuple[list[str], dict[str, torch.Tensor]]] = []  # (files read, weights) per reload
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self._answer(200, {"data": [{"id": "base", "parent": None, "max_model_len": 256}]})

            def do_POST(self):  # noqa: N802
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                with lock:
                    server.requests.append((self.path, body))
                if self.path in missing:
                    return self._answer(404, {"detail": "Not Found"})
                if self.path == "/v1/completions":
                    time.sleep(delay)
                    return self._answer(200, server.complete(body))
                if self.path == "/collective_rpc" and body.get("method") == "reload_weights":
                    server.reload(Path(body["kwargs"]["weights_path"]))
                self._answer(200, "Success" if "lora" in self.path else {"results": [None]})

            def _answer(self, status, payload):
                send_json(self, status, payload if isinstance(payload, str) else json.dumps(payload))

            def log_message(self, *args):
                pass

        self.scorer, self.off, self.eos, self.refreshes_head = scorer, off, eos, refreshes_head
        self.served = None  # the model a reload wrote into (its LM head untied), once there was one
        super().__init__(Handler)
        self.base = self.url.removesuffix("/v1")

    def complete(self, body: dict) -> dict:
        if body.get("prompt_logprobs") is not None:  # the model check's probe
            ids = torch.tensor([body["prompt"]])
            model = self.scorer if self.served is None else self.served
            with torch.no_grad(), (self.scorer.disable_adapter() if self.served is None else contextlib.nullcontext()):
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            per = logp.gather(-1, ids[0, 1:, None])[:, 0] - self.off
            entries = [None] + [{str(t): {"logprob": float(v)}} for t, v in zip(body["prompt"][1:], per)]
            return {"choices": [{"index": 0, "token_ids": [0], "logprobs": {"token_logprobs": [-1.0]},
                                 "prompt_logprobs": entries}]}
        choices = [{"index": k, "token_ids": [k + 10, self.eos], "logprobs": {"token_logprobs": [-0.5, -0.5]}}
                   for k in reversed(range(body["n"]))]  # out of order: the client sorts by index
        return {"choices": choices}

    def reload(self, folder: Path) -> None:
        """What vLLM's reload_weights reads from `folder` (its default loader): every *.safetensors file, only those
        its index names when there is one (vllm.model_executor.model_loader: filter_duplicate_safetensors_files)."""
        files = sorted(folder.glob("*.safetensors"))
        index = folder / "model.safetensors.index.json"
        if index.exists():
            named = set(json.loads(index.read_text())["weight_map"].values())
            files = [f for f in files if f.name in named]
        weights = {}
        for f in files:
            weights.update(load_file(f))
        self.reloaded.append(([f.name for f in files], weights))
        if self.scorer is None:
            return
        if self.served is None:  # the base the server started with, its head a copy of its own (the CPU build)
            self.served = copy.deepcopy(self.scorer).unload()  # peft's layers taken out: HF's names
            head = self.served.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        own = dict(self.served.named_parameters())  # the head under its own name now
        with torch.no_grad():
            for name, weight in weights.items():
                if name in own and (name != "lm_head.weight" or self.refreshes_head):
                    own[name].copy_(weight)

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]
