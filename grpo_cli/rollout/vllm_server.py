"""The vLLM-server sampler (`sampler=vllm_server`): the sampler contract of hf.py, sampled by a running vLLM
OpenAI-compatible server, and the push of the policy's weights to it through vLLM's own endpoints.

    grpo serve                                                   # starts vLLM's server for the run's model
    grpo train sampler=vllm_server sampler.url=http://127.0.0.1:8000

Nothing here serves: the server is vLLM's (`python -m vllm.entrypoints.openai.api_server`, which `grpo serve`
starts with the run's model, LoRA rank, dtype and lengths; grpo_cli/serving.py). This module is its client.

Sampling. Prompts go in as token ids (`/v1/completions` with `prompt` a list of ids), one request per prompt with
`n` = G and the prompt's seed, all of a call's requests in flight at once so the server batches them, exactly the
`SamplingParams` the in-process engine builds (vllm.py): `logprobs=0`, `ignore_eos` with the tokenizer's EOS as
the only stop id, the seed drawn from the caller's generator. So a run samples the same completions on either
engine wherever vLLM itself is deterministic. The server must run with `--logprobs-mode raw_logprobs` (the
trainer's `sampler/logp_gap` and the importance-sampling correction read them); `connect` checks that it does.

Weights. The server holds its own copy, refreshed when the policy changed (`sync`, or `generate` after eval's
adapter switch):
  - LoRA (`model.finetune=lora`): the active adapter only, written as a peft folder (adapter_config.json +
    adapter_model.safetensors, a few MB) under `sampler.adapter_dir` and loaded with `/v1/load_lora_adapter` under
    a new name per policy version (`grpo-<run>-v<N>`: a new name is a new prefix-cache key, so no KV of an old
    version is reused); the version before is unloaded. Requests name the adapter; with adapters off (eval's base
    pass) they name the base model. The server needs `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1.
  - Full weights (`model.finetune=full`): every weight written as a safetensors folder, a file per part of the
    model (the embeddings, each decoder layer, the final norm) with HF's index, then vLLM's in-place reload
    (`/collective_rpc` `reload_weights` with its path: its loader reads every file the index names, and repacks
    the CPU build's layers too) and `/reset_prefix_cache`; these are vLLM's development endpoints
    (VLLM_SERVER_DEV_MODE=1). A tied LM head (SmolLM2: the head is the embeddings) is also written under its own
    name, lm_head.weight: vLLM's CPU build computes the logits with the head's own packed copy of the embeddings
    (vocab_parallel_embedding.py's process_weights_after_loading), which its reload repacks only for a layer the
    folder names a weight of; without it the server's head stayed as it started. After the reload the server's
    log-probs of a probe prompt are checked against the pushed policy's (`_check_push`): a reload that left a
    weight behind stops the run in one line instead of sampling from another model. vLLM's NCCL and CUDA-IPC
    transfer engines (`/init_weight_transfer_engine`, `/update_weights`) move weights without a file between GPUs;
    they are not used here (no GPU has run them with grpo-cli yet: docs/sampling-vllm.md).
A version is used only once the server said it loaded it, so a trainer killed mid-push leaves the server serving
its last complete version, and the resumed run pushes again.

Many ranks, one server: under torchrun every rank samples its own share of the prompts from the same server; only
rank 0 writes and pushes, and the others take the version's name from it (a broadcast, which also keeps every
rank from sampling before the push has finished). The adapter folder must be one the server reads: on another
machine, set `sampler.adapter_dir` to a shared folder. With trainer.fsdp=true (grpo_cli/fsdp.py) a LoRA adapter is
whole on every rank, so rank 0 writes it from its own copy and the push reads no base weight; a full-parameter
policy's weights are sharded, so every rank joins the gather of each weight, a layer at a time, and rank 0 writes
each layer's file as it comes (no rank holds the whole model for the push); the model check's forward, a collective
then, runs on every rank.

Faults. An unreachable server is a ConfigError before the model loads (`check_server`, with the command that starts
one); a server with another model (its vocabulary, or the log-probs of a probe prompt) is refused at `start`; a
server that dies or hangs mid-run is one RunError line within `sampler.timeout_s`, and the run's checkpoints stay
as they were (`grpo train resume=RUN` once it is back).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from grpo_cli import server_url
from grpo_cli.checkpoint import WEIGHTS_INDEX
from grpo_cli.checks import Check, Rule, get, is_num
from grpo_cli.distributed import init_world
from grpo_cli.errors import ConfigError, DataError, RunError
from grpo_cli.fsdp import root_gathered, sharded, weights_stamp, whole_parts
from grpo_cli.lengths import check_prompts
from grpo_cli.policy import adapter_enabled, pad_id, trains_adapter
from grpo_cli.rollout import Rollout, Sampler, encode_prompts, finish, render_prompts, request_seeds
from grpo_cli.rollout.adapter import write_adapter
from grpo_cli.rollout.server_probe import (
    PROBE_TOLERANCE,
    PUSH_FACTOR,
    PUSH_FLOOR,
    probe_logprobs,
    prompt_logprob,
    tied_head,
)
from grpo_cli.rollout.vllm import fingerprint
from grpo_cli.rollout.vllm_engine import base_model

# what an unreachable server's error line suggests
START = server_url.START
# at most this many requests in flight at once (one per prompt): the server batches what arrives together
MAX_IN_FLIGHT = 64


@dataclass
class VLLMServerSampler(Sampler):
    """The `sampler` settings (conf/sampler/vllm_server.yaml) and a client of a running vLLM server."""

    engine_name = "vLLM server"  # the console's name for it (engine.say); a class attribute, not a setting

    url: str
    model: str | None
    timeout_s: float
    adapter_dir: str | None
    # what `grpo serve` starts the server with (grpo_cli/serving.py); the client does not read them
    dtype: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False
    cpu_kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.3
    max_loras: int = 2

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        self.base_name: str | None = None  # the served base model's name, once connected
        self.longest: int | None = None  # the longest sequence the server holds, once connected
        self.serving: str | None = None  # the name requests ask for: the base, or the pushed adapter's
        self._pushed = None  # fingerprint of the policy weights the requests sample from now
        self._adapter: tuple | None = None  # (fingerprint, name) of the adapter version the server holds
        self._version = 0  # policy versions pushed by this process
        self._run = uuid.uuid4().hex[:8]  # this process's adapters' prefix: runs sharing a server never collide
        self._folder: tempfile.TemporaryDirectory | None = None  # adapter_dir=null: a folder of this process
        self._written: Path | None = None  # the folder of the version the server holds (deleted at the next push)
        self.last_push: dict = {}  # bytes and seconds of the newest push (docs/speed.md)
        self.held: list[str] = []  # versions that rollouts in flight name (Pending): unloaded only once taken
        self._start_gap = 0.0  # the model check's mean log-prob gap: the two sides' precision, the push check's scale
        self._loaded: list[str] = []  # adapter versions this process loaded and has not unloaded

    # ---- the contract ------------------------------------------------------------------------

    def start(self, policy, section, job=None):
        """Connect, check that the server serves this policy's base model, and push the weights."""
        self.connect(policy)
        self._push(policy)
        return section

    def sync(self, policy) -> None:
        self._push(policy)

    def gathered(self, policy) -> contextlib.AbstractContextManager:
        """Nothing gathered while sampling: the server holds its own weights (pushed by `sync`), so under
        trainer.fsdp the ranks keep 1/N of the base throughout the rollout."""
        return contextlib.nullcontext()

    def generate(self, model, tokenizer, prompts: list[str], n: int, **options) -> Rollout:
        self._push(model)
        return super().generate(model, tokenizer, prompts, n, **options)

    def engine(self, policy, tokenizer, *, greedy: bool, generator: torch.Generator | None,
               temperature: float | None = None):
        """grpo_cli.env's Engine on the server, the policy's weights pushed first."""
        self._push(policy)
        return ServerEngine(self, tokenizer.eos_token_id, greedy, generator, temperature or self.temperature)

    # ---- sampling ----------------------------------------------------------------------------

    def _generate(self, model, tokenizer, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None) -> Rollout:
        call = self.prepare(model, tokenizer, prompts, n, greedy=greedy, max_new_tokens=max_new_tokens,
                            temperature=temperature, generator=generator)
        return self.build(call, self.complete(call.bodies))

    def prepare(self, model, tokenizer, prompts: list[str], n: int, *, greedy: bool, max_new_tokens: int,
                temperature: float, generator: torch.Generator | None) -> Call:
        """One call's requests (the version the server holds now), nothing sent: the prompts checked and encoded,
        one seed per prompt drawn from the caller's generator, as the in-process engine draws them (vllm.py)."""
        check_prompts(model, tokenizer, prompts, self.max_prompt_tokens, max_new_tokens)
        ids, mask = encode_prompts(tokenizer, prompts)  # [B, P], left-padded
        seeds = request_seeds(generator, len(prompts), n)
        rows = [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]
        bodies = [self.request(row, n=n, max_tokens=max_new_tokens, eos=tokenizer.eos_token_id, greedy=greedy,
                               temperature=temperature, seed=seed) for row, seed in zip(rows, seeds)]
        return Call(rows, n, bodies, tokenizer, next(model.parameters()).device)

    def build(self, call: Call, answers: list[list[tuple[list[int], list[float]]]]) -> Rollout:
        """The rollout of one call from the server's answers: rows grouped by prompt, vLLM's raw log-probs kept."""
        tokenizer, n = call.tokenizer, call.n
        eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)
        samples = [c for out in answers for c in out]  # [N] (token ids, log-probs), grouped
        width = max(len(tokens) for tokens, _ in samples)
        completion = torch.full((len(samples), width), pad, dtype=torch.long)  # [N, T]
        logp = torch.zeros((len(samples), width), dtype=torch.float32)  # [N, T]
        for i, (tokens, lps) in enumerate(samples):
            completion[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logp[i, :len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        longest = max(map(len, call.rows))
        ids = torch.full((len(call.rows), longest), pad, dtype=torch.long)  # [B, P], left-padded again
        mask = torch.zeros((len(call.rows), longest), dtype=torch.long)
        for i, row in enumerate(call.rows):
            ids[i, longest - len(row):], mask[i, longest - len(row):] = torch.tensor(row), 1
        device = call.device
        rollout = finish(tokenizer, ids.repeat_interleave(n, 0).to(device), mask.repeat_interleave(n, 0).to(device),
                         completion.to(device), eos, pad)
        rollout.sampling_logp = logp.to(device) * rollout.completion_mask  # 0 after EOS
        return rollout

    def submit(self, policy, tokenizer, examples: list[dict], n: int, generator: torch.Generator,
               pool: ThreadPoolExecutor) -> Pending:
        """Sample `examples` in the background (algo.max_staleness, rollout/ahead.py): the policy's weights pushed
        and the requests prepared here, the HTTP calls on `pool`; the version they name stays loaded until
        `Pending.result` has returned."""
        self._push(policy)
        prompts = render_prompts(tokenizer, [e["messages"] for e in examples])
        per_call = len(prompts) if self.batch_size is None else max(1, self.batch_size // n)
        calls = [self.prepare(policy, tokenizer, prompts[i:i + per_call], n, greedy=False,
                              max_new_tokens=self.max_new_tokens, temperature=self.temperature, generator=generator)
                 for i in range(0, len(prompts), per_call)]
        self.held.append(self.serving)
        return Pending(self, calls, [pool.submit(self.complete, c.bodies) for c in calls], self.serving)

    def request(self, prompt: list[int], *, n: int, max_tokens: int, eos: int, greedy: bool, temperature: float,
                seed: int | None) -> dict:
        """One `/v1/completions` body: the in-process engine's SamplingParams, as JSON."""
        sampling = ({"temperature": 0.0} if greedy else
                    {"temperature": temperature, "top_p": self.top_p, "top_k": self.top_k if self.top_k else -1,
                     "seed": seed})
        return {"model": self.serving, "prompt": prompt, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                "ignore_eos": True, "stop_token_ids": [eos], "return_token_ids": True,
                "skip_special_tokens": False, **sampling}

    def complete(self, bodies: list[dict]) -> list[list[tuple[list[int], list[float]]]]:
        """Each body's choices in index order, as (token ids, their raw log-probs), all bodies in flight at once."""
        if not bodies:
            return []
        with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(bodies))) as pool:
            outputs = list(pool.map(lambda body: self.post("/v1/completions", body), bodies))
        return [[_choice(c) for c in sorted(out["choices"], key=lambda c: c["index"])] for out in outputs]

    # ---- the server: connect, check, push ----------------------------------------------------

    def connect(self, policy) -> None:
        """The served base model's name, checked against the policy: the same vocabulary and the same log-probs
        of a probe prompt (another model, or another precision far off, is refused), and raw log-probs."""
        models = self.get("/v1/models")
        names = [m["id"] for m in models.get("data", []) if not m.get("parent")]
        if self.model is not None and self.model not in names:
            raise ConfigError(f"the vLLM server at {self.url} serves {', '.join(names) or 'no model'}, not "
                              f"sampler.model={self.model}; set sampler.model to one of them, or null")
        self.base_name = self.model or (names[0] if names else None)
        if self.base_name is None:
            raise ConfigError(f"the vLLM server at {self.url} serves no model; start it with: {START}")
        self.serving = self.base_name
        served = next(m for m in models["data"] if m["id"] == self.base_name)
        self.longest = served.get("max_model_len")  # the server's longest sequence (multi-turn budgets)
        self._check_model(policy, served)

    @torch.no_grad()
    def _check_model(self, policy, served: dict) -> None:
        """Refuse a server whose model is not the policy's base: its vocabulary size, then the mean |difference|
        of the log-probs both give a probe prompt (prompt_logprobs, no sampling)."""
        # a sharded base (trainer.fsdp) gathers each layer in this forward: every rank runs it (connect runs on every
        # rank), before any request that could fail on one rank alone
        with adapter_enabled(policy, False):
            probe, ours = probe_logprobs(policy)
        # rank 0 alone asks, and every rank takes its answer: vLLM 0.32's CPU build with LoRA on fails two
        # prompt-logprob requests at once (its LoRA logits path sizes its indices by request, not by prompt token:
        # the engine dies), which N ranks starting together sent
        world = init_world()
        gap = world.broadcast(self._probe_gap(probe, ours) if world.main else None)
        if gap > PROBE_TOLERANCE or served.get("max_model_len") is None:
            raise ConfigError(f"the vLLM server at {self.url} serves another model than this run's "
                              f"({self.base_name}: log-probs of a probe prompt differ by {gap:.3g} nats on average "
                              f"from the policy's base, > {PROBE_TOLERANCE}); start the server for this model with: "
                              f"{START}")
        self._start_gap = gap

    @torch.no_grad()
    def _check_push(self, policy, world) -> None:
        """After a full push, the server answers the probe as the weights it was sent do, or the run stops in one line:
        a reload that left a weight behind (vLLM's CPU build kept its LM head's packed copy of the embeddings before
        the head was written under its own name) samples from another model without a sound. The policy's forward
        runs on every rank that joined the push (a sharded policy gathers in it); rank 0 asks the server."""
        # a sharded root keeps its weights gathered after a forward (FSDP's default): freed again at the end, so the
        # update starts from the shards as it does without the check
        with root_gathered(policy):
            probe, ours = probe_logprobs(policy)
        if not world.main:
            return
        gap = self._probe_gap(probe, ours)
        limit = max(PUSH_FLOOR, PUSH_FACTOR * self._start_gap)
        self.last_push["gap"] = gap
        if gap > limit:
            raise RunError(f"the vLLM server at {self.url} answers a probe prompt {gap:.3g} nats on average from the "
                           f"weights just pushed (> {limit:.3g}): its reload_weights left a weight behind (on vLLM's "
                           f"CPU build: a layer's packed copy it did not refresh); sample a full-parameter run "
                           f"with sampler=vllm, model.finetune=lora, or a server on a GPU; the run's checkpoints are "
                           f"as they were")

    def _probe_gap(self, probe: list[int], ours: torch.Tensor) -> float:
        """Mean |our log-prob - the server's| over the probe's tokens after the first (the base model's name)."""
        body = {"model": self.base_name, "prompt": probe, "max_tokens": 1, "prompt_logprobs": 0, "logprobs": 0,
                "temperature": 0.0, "return_token_ids": True}
        out = self.post("/v1/completions", body)["choices"][0]
        theirs = [prompt_logprob(entry, tok) for entry, tok in zip(out["prompt_logprobs"][1:], probe[1:])]
        return (ours - torch.tensor(theirs)).abs().mean().item()

    @torch.no_grad()
    def _push(self, policy) -> None:
        """The policy's current weights to the server when they changed since the last push: the adapter (LoRA) or
        every weight (full); rank 0 pushes, every rank then samples the version it names. A full-parameter policy
        sharded over the ranks (trainer.fsdp) is gathered for the push by every rank, a layer at a time (a LoRA
        policy's adapter is whole on rank 0), and the server's answer to the probe prompt checked after it
        (`_check_push`). With adapters off (eval's base pass) requests name the base model, and the adapter stays
        loaded for the pass after."""
        if self.base_name is None:
            self.connect(policy)
        world = init_world()
        gathers = not trains_adapter(policy) and sharded(policy)  # every rank joins the stamp and the push
        stamp = weights_stamp(policy, world) if gathers else fingerprint(policy)
        if stamp == self._pushed:
            return
        name = None
        if world.main or gathers:
            t = time.perf_counter()
            adapters = trains_adapter(policy)
            if adapters and not stamp:  # no adapter active: the base model, nothing to push
                name, sent = self.base_name, 0
            elif adapters and self._adapter is not None and self._adapter[0] == stamp:  # back from the base pass
                name, sent = self._adapter[1], 0
            elif adapters:
                name, sent = self._push_adapter(policy)
                self._adapter = (stamp, name)
            else:
                name, sent = self._push_full(policy, world)
            if world.main:
                self.last_push = {"bytes": sent, "seconds": time.perf_counter() - t, "name": name}
            if not adapters:  # the server against what it was sent: a forward on every rank that pushed
                self._check_push(policy, world)
        self.serving = world.broadcast(name)  # also: no rank samples before rank 0's push has finished
        self._pushed = stamp

    def _push_adapter(self, policy) -> tuple[str, int]:
        """The active adapter as a peft folder, loaded under a new name; the version before unloaded."""
        self._version += 1
        name = f"grpo-{self._run}-v{self._version}"
        folder = self._new_folder(name)
        sent = write_adapter(policy, folder)
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, text=True)
        self._loaded.append(name)
        self.retire()
        self._keep(folder)
        return name, sent

    def _push_full(self, policy, world) -> tuple[str | None, int]:
        """Every weight as safetensors files, one per part of the model (the embeddings, each decoder layer, the final
        norm: HF's sharded layout and its index, read as vLLM's loader reads a checkpoint folder: every *.safetensors
        file its index names), reloaded in place by vLLM (its dev endpoints). Rank 0 writes and calls the server. A
        policy sharded over the ranks (trainer.fsdp) is gathered one weight at a time, every rank joining, and rank
        0 holds one part on the host while it writes it (fsdp.whole_parts); the other ranks return (None, 0)."""
        folder = None
        if world.main:
            self._version += 1
            folder = self._new_folder(f"grpo-{self._run}-full-v{self._version}")
        weight_map, sent = {}, 0
        base = base_model(policy)
        tied, embeddings = tied_head(base), None
        for number, count, part in whole_parts(base, world.main):
            if world.main:
                if tied and tied[0] in part:
                    embeddings = part[tied[0]]  # [vocab, hidden], on the host
                if tied and number == count:
                    # the tied head under its own name too, in the last file as an untied model's head (a copy:
                    # safetensors keeps one name per storage). vLLM's CPU build computes the logits with the head's
                    # own packed copy of the embeddings, which a reload repacks only when the folder names the head
                    part[tied[1]] = embeddings.clone()
                file = f"model-{number:05d}-of-{count:05d}.safetensors"
                save_file(part, folder / file, metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(part, file))
                sent += sum(v.numel() * v.element_size() for v in part.values())
        if not world.main:
            return None, 0
        index = {"metadata": {"total_size": sent}, "weight_map": weight_map}
        (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))
        self.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self.post("/reset_prefix_cache", None, text=True)
        self._keep(folder)
        return self.base_name, sent

    def _new_folder(self, name: str) -> Path:
        """A new folder for one version's files, under sampler.adapter_dir or this process's temporary folder."""
        if self.adapter_dir is None and self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="grpo-push-")
        root = Path(self.adapter_dir).expanduser() if self.adapter_dir else Path(self._folder.name)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder.resolve()

    def retire(self) -> None:
        """Unload the adapter versions this process loaded that nothing samples from any more: all but the newest
        and those rollouts in flight name (`held`). An unload that fails costs server memory, never the run."""
        for name in self._loaded[:-1]:
            if name in self.held:
                continue
            self._loaded.remove(name)
            try:
                self.post("/v1/unload_lora_adapter", {"lora_name": name}, text=True)
            except (RunError, DataError):
                pass

    def _keep(self, folder: Path) -> None:
        """The server holds `folder`'s version now (it read the files when it loaded them): the one before goes."""
        if self._written is not None and self._written != folder:
            shutil.rmtree(self._written, ignore_errors=True)
        self._written = folder

    # ---- HTTP --------------------------------------------------------------------------------

    def get(self, path: str) -> dict:
        return self._call(urllib.request.Request(self.url + path), text=False)

    def post(self, path: str, body, *, text: bool = False):
        data = b"" if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        return self._call(request, text=text)

    def _call(self, request: urllib.request.Request, text: bool):
        """The server's answer (JSON, or text for the LoRA endpoints); a server that is gone or silent for
        `timeout_s` is one RunError line, a refused request one DataError line with the server's reason."""
        path = urllib.parse.urlsplit(request.full_url).path
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as err:
            reason = _server_reason(err)
            if err.code == 404 and path in ("/v1/load_lora_adapter", "/collective_rpc", "/reset_prefix_cache"):
                need = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora" if "lora" in path
                        else "VLLM_SERVER_DEV_MODE=1")
                raise RunError(f"the vLLM server at {self.url} has no {path} endpoint: it was started without "
                               f"{need}; start it with: {START}") from None
            raise DataError(f"the vLLM server at {self.url} refused {path} (HTTP {err.code}: {reason})") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:  # refused, reset, cut, timed out
            why = getattr(err, "reason", err)
            raise RunError(f"the vLLM server at {self.url} did not answer {path} ({why}; sampler.timeout_s="
                           f"{self.timeout_s:g}); a training run's checkpoints are as they were: start the server "
                           f"again and go on with grpo train resume=RUN (eval and sample: run them again)") from None
        if text:
            return raw.decode(errors="replace")
        return json.loads(raw) if raw else {}


@dataclass
class Call:
    """One engine call's requests, and what turns the answers into its rollout."""

    rows: list[list[int]]  # B prompts' token ids, unpadded
    n: int  # completions per prompt
    bodies: list[dict]  # B /v1/completions bodies
    tokenizer: object
    device: torch.device


@dataclass
class Pending:
    """Rollouts in flight (`VLLMServerSampler.submit`): `result()` waits for them and frees their version."""

    sampler: VLLMServerSampler
    calls: list[Call]
    futures: list
    version: str

    def answers(self) -> list[list[list[tuple[list[int], list[float]]]]]:
        """Each call's answers, once the server has given them (a fault: the HTTP call's one-line error); a future
        keeps its result, so a checkpoint's wait and the step's take read the same answers."""
        try:
            return [f.result() for f in self.futures]
        finally:
            if self.version in self.sampler.held:
                self.sampler.held.remove(self.version)

    def result(self) -> Rollout:
        parts = [self.sampler.build(c, a) for c, a in zip(self.calls, self.answers())]
        return Rollout.cat(parts, pad=pad_id(self.calls[0].tokenizer))


@dataclass
class ServerEngine:
    """grpo_cli.env's Engine on the server: token-id sequences in, each row's new ids out up to and including its
    EOS, one seed per row from `generator` (greedy: none), as VLLMEngine does in process. `logprobs`: per row of the
    last call, the server's raw log-prob of each id it returned."""

    sampler: VLLMServerSampler
    eos_token_id: int
    greedy: bool
    generator: torch.Generator | None
    temperature: float
    logprobs: list[list[float]] | None = field(default=None, init=False)

    def continue_batch(self, sequences: list[list[int]], max_new: int) -> list[list[int]]:
        s, eos = self.sampler, self.eos_token_id
        seeds = [None] * len(sequences) if self.greedy else request_seeds(self.generator, len(sequences))
        longest = s.longest or s.max_model_len or 10**9
        bodies = [s.request(list(q), n=1, max_tokens=max(1, min(max_new, longest - len(q))), eos=eos,
                            greedy=self.greedy, temperature=self.temperature, seed=seed)
                  for q, seed in zip(sequences, seeds, strict=True)]
        out, logprobs = [], []
        for (tokens, lps), *_ in s.complete(bodies):
            end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
            out.append(tokens[:end])
            logprobs.append(lps[:end])
        self.logprobs = logprobs
        return out


def _choice(choice: dict) -> tuple[list[int], list[float]]:
    """(token ids, raw log-prob of each) of one completion choice."""
    tokens = list(choice["token_ids"])
    return tokens, [float(x) for x in choice["logprobs"]["token_logprobs"]][:len(tokens)]


def _server_reason(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return err.reason or "no reason given"
    # vLLM's errors: {"error": {"message": ...}}; FastAPI's own (an unknown path, a bad body): {"detail": ...}
    message = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(message, dict):
        message = message.get("message", message)
    return " ".join(str(message).split())[:300]


# ---- config checks: collected by config.validate ------------------------------------------------

def check_server(cfg: DictConfig) -> list[str]:
    """sampler=vllm_server: a server answers at sampler.url, checked before any model loads (at most 5 s)."""
    # grpo serve's own config (a `serve` section) starts the server this check would look for
    if str(get(cfg, "sampler._target_")[1]) != f"{__name__}.VLLMServerSampler" or "serve" in cfg:
        return []
    timeout = min(5.0, float(get(cfg, "sampler.timeout_s")[1] or 5.0))
    found = server_url.problem(str(get(cfg, "sampler.url")[1] or ""), timeout)
    return [found] if found else []


CHECKS: list[Check] = [
    Rule("sampler.timeout_s", lambda v: v is None or (is_num(v) and v > 0),
         "must be > 0 (seconds); set sampler.timeout_s=600"),
    check_server,
]
