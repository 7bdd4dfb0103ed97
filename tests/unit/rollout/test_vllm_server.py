"""The vLLM-server sampler's client against a stand-in server on loopback: the requests it sends (the in-process
engine's sampling settings), the rollout it builds from the answers, the adapter push (a peft folder under a new name
per version, the one before unloaded), the model check, and one line for each fault. vLLM's own server on the
embedded model: tests/integration/test_vllm_server.py."""

from __future__ import annotations

import contextlib
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError, DataError, RunError
from grpo_cli.policy import build_policy
from grpo_cli.rollout.server_probe import tied_head
from grpo_cli.rollout.vllm_server import START, VLLMServerSampler
from tests.fake_vllm import FakeVLLM
from tests.helpers.engines import needs_vllm, set_adapter
from tests.helpers.judge import LocalServer
from tests.helpers.runs import sampler_settings, tiny_cfg


@pytest.fixture()
def policy_and_tokenizer():
    policy, tokenizer, _ = build_policy(tiny_cfg().model)
    return policy, tokenizer


def sampler(url: str, **overrides) -> VLLMServerSampler:
    return VLLMServerSampler(**sampler_settings("vllm_server", url=url, **overrides))


def test_start_checks_the_model_and_samples_with_the_in_process_engines_settings(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path), max_new_tokens=5)
        s.start(policy, None)
        rollout = s.generate(policy, tokenizer, ["ab", "abcd"], 3, generator=torch.Generator().manual_seed(0))
    bodies = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]
    assert len(bodies) == 2  # one request per prompt, n = 3 each
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in ("ab", "abcd")]
    assert sorted(map(len, (b["prompt"] for b in bodies))) == sorted(map(len, ids))  # token ids, no padding
    for body in bodies:
        assert body["n"] == 3 and body["max_tokens"] == 5 and body["logprobs"] == 0 and body["ignore_eos"] is True
        assert body["stop_token_ids"] == [tokenizer.eos_token_id] and body["temperature"] == 1.0
        assert isinstance(body["seed"], int) and body["model"].startswith("grpo-")  # the pushed adapter's name
    assert len({b["seed"] for b in bodies}) == 2  # a seed of its own per prompt
    # rows grouped by prompt, choices in index order: 10 EOS, 11 EOS, 12 EOS per group
    assert rollout.completion_ids[:, 0].tolist() == [10, 11, 12, 10, 11, 12]
    assert rollout.completion_mask.sum(1).tolist() == [2] * 6 and rollout.truncated == [False] * 6
    assert torch.allclose(rollout.sampling_logp, torch.full((6, 2), -0.5))


def test_greedy_requests_carry_no_seed_and_the_same_generator_gives_the_same_seeds(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path))
        s.start(policy, None)
        s.generate(policy, tokenizer, ["ab"], 1, greedy=True)
        for _ in range(2):
            s.generate(policy, tokenizer, ["ab", "b"], 2, generator=torch.Generator().manual_seed(7))
    bodies = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]
    assert bodies[0]["temperature"] == 0.0 and "seed" not in bodies[0]
    # by prompt: the requests arrive in any order
    seeds = [{len(b["prompt"]): b["seed"] for b in part} for part in (bodies[1:3], bodies[3:5])]
    assert seeds[0] == seeds[1] and len(set(seeds[0].values())) == 2  # a run and its resume alike


def test_the_adapter_is_pushed_as_a_peft_folder_under_a_new_name_per_version(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path))
        s.start(policy, None)
        first = s.serving
        s.sync(policy)  # nothing changed: nothing pushed
        set_adapter(policy, seed=1)
        s.sync(policy)
        second = s.serving
        with policy.disable_adapter():  # eval's base pass: the base model's name, nothing pushed
            s.generate(policy, tokenizer, ["ab"], 1, greedy=True)
            assert s.serving == "base"
        s.generate(policy, tokenizer, ["ab"], 1, greedy=True)
        assert s.serving == second  # back from the base pass: the adapter the server still holds, not pushed again
        set_adapter(policy, seed=2)
        s.sync(policy)
    loads = [b for p, b in server.requests if p == "/v1/load_lora_adapter"]
    assert [b["lora_name"] for b in loads] == [first, second, s.serving]
    assert [n[-3:] for n in (first, second, s.serving)] == ["-v1", "-v2", "-v3"]
    assert [b["lora_name"] for p, b in server.requests if p == "/v1/unload_lora_adapter"] == [first, second]
    folder = Path(loads[-1]["lora_path"])
    assert sorted(f.name for f in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not Path(loads[0]["lora_path"]).exists()  # the version before is deleted once replaced
    saved = load_file(folder / "adapter_model.safetensors")
    own = {n: p for n, p in policy.named_parameters() if "lora_B" in n}
    key = next(k for k in saved if "lora_B" in k)
    assert torch.equal(saved[key], own[key.replace(".weight", ".default.weight")].detach())  # peft's own layout
    assert s.last_push["bytes"] == sum(v.numel() * 4 for v in saved.values())


def _full_push(policy_and_tokenizer, folder: Path, **fake) -> FakeVLLM:
    """A full-parameter tiny policy pushed at start, then again after a step moved its final norm and its embeddings
    (also its tied LM head: the tiny model ties them, as SmolLM2 does); the stand-in server, `fake` its settings."""
    scorer, tokenizer = policy_and_tokenizer  # the same seeded base
    policy, _, _ = build_policy(tiny_cfg("model.finetune=full").model)
    with FakeVLLM(scorer, eos=tokenizer.eos_token_id, **fake) as server:
        server.policy, server.sampler = policy, sampler(server.base, adapter_dir=str(folder))
        server.sampler.start(policy, None)
        with torch.no_grad():
            policy.model.norm.weight.add_(1.0)
            policy.model.embed_tokens.weight.mul_(3.0)
        server.sampler.sync(policy)
    return server


def test_full_weights_are_pushed_a_file_per_part_and_reloaded_in_place(policy_and_tokenizer, tmp_path):
    server = _full_push(policy_and_tokenizer, tmp_path)
    rpc = [b for p, b in server.requests if p == "/collective_rpc"]
    assert [b["method"] for b in rpc] == ["reload_weights"] * 2 and server.paths().count("/reset_prefix_cache") == 2
    folder = Path(rpc[-1]["kwargs"]["weights_path"])
    # the embeddings, layer 0, layer 1, the final norm (and the tied LM head); HF's index names each weight's file
    parts = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(f.name for f in folder.iterdir()) == [*parts, "model.safetensors.index.json"]
    assert not Path(rpc[0]["kwargs"]["weights_path"]).exists()  # the version before is deleted once replaced
    files, weights = server.reloaded[-1]
    own = dict(server.policy.named_parameters())  # a tied weight once: no lm_head.weight
    assert files == parts and weights.keys() == {*own, "lm_head.weight"}
    assert all(torch.equal(weights[k], own[k].detach()) for k in own)
    assert not torch.equal(server.reloaded[0][1]["model.norm.weight"], weights["model.norm.weight"])


def test_a_tied_lm_head_is_pushed_under_its_own_name_too(policy_and_tokenizer, tmp_path):
    """vLLM's CPU build computes the logits with its own packed copy of the tied embeddings, which its reload
    refreshes only from a weight named lm_head.weight (the stand-in does the same): the push writes the embeddings
    under that name as well, so the server answers with the pushed head, and the check after the push passes."""
    server = _full_push(policy_and_tokenizer, tmp_path)
    _, weights = server.reloaded[-1]
    embeddings = server.policy.model.embed_tokens.weight.detach()
    assert torch.equal(weights["lm_head.weight"], embeddings)
    assert torch.equal(server.served.lm_head.weight.detach(), embeddings)  # the server's head moved with the push
    # probes: the model check at the start, then one after each of the 2 pushes, each the policy's own (fp32 both)
    probes = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is not None]
    assert len(probes) == 3 and server.sampler.last_push["gap"] < 1e-5
    own = dict(server.policy.named_parameters())
    assert server.sampler.last_push["bytes"] == sum(v.numel() * 4 for v in own.values()) + embeddings.numel() * 4


def test_a_server_whose_reload_leaves_the_tied_head_behind_stops_the_run_in_one_line(policy_and_tokenizer, tmp_path):
    """A server whose reload never refreshes its LM head's copy (vLLM's CPU build before the head was pushed under its
    own name, or a model whose loader skips it): after the push its log-probs are another model's, and the run
    stops with the problem and the fixes instead of sampling from a head that never moves."""
    with pytest.raises(RunError) as err:
        _full_push(policy_and_tokenizer, tmp_path, refreshes_head=False)
    line = str(err.value)
    assert line.startswith("the vLLM server at http://127.0.0.1:") and len(line.splitlines()) == 1
    assert "nats on average from the weights just pushed" in line, line
    assert "sampler=vllm, model.finetune=lora, or a server on a GPU" in line, line


def test_the_tied_head_is_found_by_identity_and_left_out_where_vllm_has_none():
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_cli.policy import load_tiny_random

    tied, _ = load_tiny_random()
    assert tied_head(tied) == ("model.embed_tokens.weight", "lm_head.weight")
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=False)
    assert tied_head(LlamaForCausalLM(config)) is None  # its own head: pushed under its name with every weight
    # vLLM computes Gemma 2's logits with the embedding layer itself: no head there to take a weight
    tied.__class__ = type("Gemma2ForCausalLM", (type(tied),), {})
    assert tied_head(tied) is None


@needs_vllm
@pytest.mark.slow
def test_vllms_own_loader_reads_the_pushed_folder(policy_and_tokenizer, tmp_path):
    """What reload_weights reads of the folder (its default loader, as vLLM's server runs it): every weight."""
    from types import SimpleNamespace

    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    server = _full_push(policy_and_tokenizer, tmp_path)
    folder = [b for p, b in server.requests if p == "/collective_rpc"][-1]["kwargs"]["weights_path"]  # the last push
    config = SimpleNamespace(model=folder, revision=None)  # reload_weights points the model config at the folder
    read = dict(get_model_loader(LoadConfig()).get_all_weights(config, torch.nn.Module()))
    own = dict(server.policy.named_parameters())
    tied = tied_head(server.policy)  # the tied head is written a second time, under its own name (vLLM CPU's head)
    if tied is not None:
        own[tied[1]] = own[tied[0]]
    assert read.keys() == own.keys() and all(torch.equal(read[k], own[k].detach()) for k in own)


@needs_vllm
@pytest.mark.slow
def test_a_full_push_reaches_the_logits_of_vllms_cpu_build(tmp_path):
    """SmolLM2 (tied embeddings), full parameters, every weight moved 2%: the folder the full push writes, reloaded by
    vLLM's own worker method (`reload_weights`, what the server's /collective_rpc runs; here an in-process engine
    answers the endpoints the push calls), gives the policy's log-probs, the LM head's included. Without the head
    written under its own name, the CPU build's head kept its packed copy of the embeddings it started with: a mean
    gap of ~0.2 nats on this text, up to ~0.6 on a token."""
    from vllm import SamplingParams

    from grpo_cli.instantiate import build
    from grpo_cli.rollout import render_prompts
    from tests.helpers.engines import PROMPTS

    policy, tokenizer, _ = build_policy(compose("train", ["model.finetune=full", "model.dtype=float32"]).model)
    policy.eval()
    engine = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=8",
                                     "sampler.cpu_kv_cache_gb=0.5"]).sampler)
    engine.sync(policy)  # the engine starts with the policy's weights

    def prompt_logprobs(ids: list[int]) -> list[float]:
        out = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                  use_tqdm=False)[0]
        return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]

    class InProcess(VLLMServerSampler):
        """The server's endpoints that connect and the full push call, answered by the engine's own methods."""

        def get(self, path):
            longest = engine.llm.llm_engine.model_config.max_model_len
            return {"data": [{"id": "base", "parent": None, "max_model_len": longest}]}

        def post(self, path, body, *, text=False):
            if path == "/collective_rpc":
                return {"results": engine.llm.collective_rpc(body["method"], kwargs=body["kwargs"])}
            if path == "/reset_prefix_cache":
                return engine.llm.reset_prefix_cache()
            assert path == "/v1/completions" and body["prompt_logprobs"] == 0, (path, body)  # the probe
            lps = prompt_logprobs(body["prompt"])
            return {"choices": [{"index": 0, "prompt_logprobs": [None] + [{str(t): {"logprob": v}}
                                                                          for t, v in zip(body["prompt"][1:], lps)]}]}

    server = InProcess(**sampler_settings("vllm_server", url="http://in-process", adapter_dir=str(tmp_path)))
    server.start(policy, None)  # the model check, then the first push (the weights the engine holds)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():  # the embeddings (and so the tied head) too
            p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g))
    server.sync(policy)
    text = render_prompts(tokenizer, PROMPTS)
    ids = [i for t in text for i in tokenizer(t, add_special_tokens=False).input_ids]  # [P], every prompt in a row
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # [P - 1, V]
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [P - 1]
    gap = (ours - torch.tensor(prompt_logprobs(ids))).abs()
    print(f"full push, reloaded: mean |vLLM - policy| log-prob {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.mean() < 1e-3 and gap.max() < 1e-2  # fp32 on both sides: ~1e-5


def test_a_server_with_another_model_is_refused(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, off=1.0, eos=tokenizer.eos_token_id) as server:
        with pytest.raises(ConfigError) as err:
            sampler(server.base, adapter_dir=str(tmp_path)).start(policy, None)
    assert "serves another model than this run's (base: log-probs of a probe prompt differ by 1 nats" in str(err.value)
    assert str(err.value).endswith(START) and len(str(err.value).splitlines()) == 1


def test_a_server_without_runtime_lora_names_what_it_needs(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, missing={"/v1/load_lora_adapter"}) as server:
        with pytest.raises(RunError) as err:
            sampler(server.base, adapter_dir=str(tmp_path)).start(policy, None)
    assert "has no /v1/load_lora_adapter endpoint: it was started without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 " \
           "and --enable-lora" in str(err.value)


def test_a_server_that_hangs_is_one_line_within_the_timeout(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path), timeout_s=60)
        s.start(policy, None)
        server.scorer = None
    with FakeVLLM(policy, delay=5, eos=tokenizer.eos_token_id) as hung:
        s.url, s.timeout_s = hung.base, 0.5
        t = time.perf_counter()
        with pytest.raises(RunError) as err:
            s.generate(policy, tokenizer, ["ab"], 2)
        assert time.perf_counter() - t < 4
    assert "did not answer /v1/completions (timed out; sampler.timeout_s=0.5)" in str(err.value)
    assert "grpo train resume=RUN" in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_refused_request_is_one_line_with_the_servers_reason(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id, missing={"/v1/completions"}) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path))
        s.base_name = s.serving = "base"
        s._pushed = ()  # connected, adapters off: no probe, no push
        with pytest.raises(DataError) as err, policy.disable_adapter():
            s.generate(policy, tokenizer, ["ab"], 1)
    assert str(err.value) == f"the vLLM server at {server.base} refused /v1/completions (HTTP 404: Not Found)"


def test_an_unreachable_server_is_refused_before_the_model_loads():
    with LocalServer(BaseHTTPRequestHandler) as free:  # a port that was free a moment ago
        port = free.httpd.server_address[1]
    t = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["sampler=vllm_server", f"sampler.url=http://127.0.0.1:{port}"]))
    assert time.perf_counter() - t < 10
    assert str(err.value) == (f"sampler=vllm_server: no vLLM server answers at http://127.0.0.1:{port} ([Errno 111] "
                              f"Connection refused); start one with: {START}")
    with pytest.raises(ConfigError, match=r"sampler.url \('localhost:8000'\) must be the server's http://HOST:PORT"):
        validate(compose("eval", ["sampler=vllm_server", "sampler.url=localhost:8000"]))


def test_multi_turn_episodes_continue_token_ids_with_a_seed_per_row(policy_and_tokenizer, tmp_path):
    policy, tokenizer = policy_and_tokenizer
    with FakeVLLM(policy, eos=tokenizer.eos_token_id) as server:
        s = sampler(server.base, adapter_dir=str(tmp_path))
        s.start(policy, None)
        engine = s.engine(policy, tokenizer, greedy=False, generator=torch.Generator().manual_seed(3))
        out = engine.continue_batch([[5, 6, 7], [5], [8, 9]], max_new=300)
    bodies = [b for p, b in server.requests if p == "/v1/completions" and b.get("prompt_logprobs") is None]
    assert sorted(b["prompt"] for b in bodies) == [[5], [5, 6, 7], [8, 9]]  # the ids as they are, nothing re-tokenized
    assert {b["n"] for b in bodies} == {1} and len({b["seed"] for b in bodies}) == 3
    # each row asks for at most what the server's longest sequence (256, from /v1/models) leaves it
    assert sorted(b["max_tokens"] for b in bodies) == [253, 254, 255]
    assert out == [[10, tokenizer.eos_token_id]] * 3 and engine.logprobs == [[-0.5, -0.5]] * 3


def test_a_server_that_dies_mid_request_is_one_line(policy_and_tokenizer, tmp_path):
    """A server killed while it answers (the connection closed with no reply, or a reply cut short)."""
    policy, tokenizer = policy_and_tokenizer

    class Dies(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.server.cut:  # headers promising 1000 bytes, then 5 of them
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"cho')
            self.close_connection = True

        def log_message(self, *args):
            pass

    for cut in (False, True):
        with LocalServer(Dies) as dead:
            dead.httpd.cut = cut
            s = sampler(dead.url.removesuffix("/v1"), adapter_dir=str(tmp_path))
            s.base_name = s.serving = "base"
            s._pushed = ()  # connected, adapters off: no probe, no push
            with pytest.raises(RunError) as err, policy.disable_adapter():
                s.generate(policy, tokenizer, ["ab"], 1)
        assert str(err.value).startswith(f"the vLLM server at {s.url} did not answer /v1/completions (")
        assert len(str(err.value).splitlines()) == 1


def test_a_command_line_naming_a_dead_server_stops_before_its_imports():
    """`grpo train sampler=vllm_server sampler.url=URL` with nothing at URL: the one line within seconds, not after
    the ~10 s of imports a command needs on a small CPU (cli.py asks first)."""
    from tests.helpers.cli import one_line_error, run_cli

    with LocalServer(BaseHTTPRequestHandler) as free:
        port = free.httpd.server_address[1]
    for command in ("train", "eval", "sample"):
        t = time.perf_counter()
        out = run_cli([command, "sampler=vllm_server", f"sampler.url=http://127.0.0.1:{port}"])
        assert time.perf_counter() - t < 10
        assert one_line_error(out) == (f"error: sampler=vllm_server: no vLLM server answers at "
                                       f"http://127.0.0.1:{port} ([Errno 111] Connection refused); start one with: "
                                       f"{START}")


def test_a_server_sampler_leaves_a_sharded_base_sharded_while_it_samples(monkeypatch):
    """The rollout's context (what recipe.py samples in): engines that sample from the policy's own weights gather a
    base sharded by trainer.fsdp (fsdp.whole, the whole base on every rank); the server holds its own copy, so the
    ranks keep 1/N of the base while it samples (the point of FSDP with a server: a model no rank holds whole)."""
    from grpo_cli import fsdp
    from grpo_cli.rollout.episodes import EpisodeSampler
    from grpo_cli.rollout.hf import HFSampler

    gathered = []
    monkeypatch.setattr(fsdp, "whole", lambda policy: gathered.append(policy) or contextlib.nullcontext())
    with sampler("http://127.0.0.1:9").gathered("policy"):
        assert gathered == []
    with EpisodeSampler(sampler("http://127.0.0.1:9"), env=None).gathered("policy"):  # episodes on the server too
        assert gathered == []
    with HFSampler(**sampler_settings()).gathered("policy"):
        assert gathered == ["policy"]
