"""Resume honours the run, run folders are guarded, checkpoint files are checked and named, non-finite steps
are skipped, every bad value stops before the model loads.

Each case asserts the exit code, that an error is one line without a traceback, and that no file of
an earlier run changed where data was at stake. Item numbers are the issue's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_cli import checkpoint
from grpo_cli.commands import train
from grpo_cli.config import compose, validate
from grpo_cli.errors import CheckpointError, ConfigError, RunError
from grpo_cli.metrics.run_files import truncate_jsonl
from grpo_cli.objective import outcome_advantages
from grpo_cli.runs import RunLock
from tests.helpers.cli import one_line_error, run_cli
from tests.helpers.runs import EVAL_TINY, TINY, copy_run, metrics, snapshot, tiny_cfg


@pytest.fixture()
def run4(four_step_run) -> Path:
    """A 4-step tiny run with G=4, 2 prompts, 8 tokens and a checkpoint at every step (conftest's session run)."""
    return four_step_run


# ---- 1. resume reads the run's own config -----------------------------------------------------

def test_cli_resume_alone_continues_with_the_runs_settings(run4, tmp_path):
    run = copy_run(run4, tmp_path / "run")
    # the command line names no model, G or length: the run's own (tiny, G=4, 8 tokens) must be used
    out = run_cli(["train", f"resume={run}/checkpoints/step_000002", "trainer.max_steps=3", "trainer.report_to=[]",
                   f"hydra.run.dir={tmp_path / 'hydra'}"])
    assert out.returncode == 0, out.stderr[-2000:]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["completions/max_length"] <= 8 and records[-1]["counts/ref_forward_seqs"] == 8  # 2 x G=4
    assert records[2] == {**records[2], **{k: metrics(run4)[2][k] for k in ("reward", "loss", "kl", "grad_norm")}}


# each a CLI start (~7 s); test_resume_in_process_compares_every_key covers every key in the fast suite
@pytest.mark.parametrize("override,key", [
    ("algo.group_size=8", "algo.group_size"),
    pytest.param("optimizer.lr=0.5", "optimizer.lr", marks=pytest.mark.slow),
    pytest.param("model.lora.r=8", "model.lora.r", marks=pytest.mark.slow),
    pytest.param("sampler.max_new_tokens=32", "sampler.max_new_tokens", marks=pytest.mark.slow),
    ("model=smollm2_135m", "model.name"),
])
def test_resume_refuses_a_change_that_alters_the_math(run4, tmp_path, override, key):
    before = snapshot(run4)
    line = one_line_error(run_cli(["train", f"resume={run4}", override, f"hydra.run.dir={tmp_path}"]))
    assert key in line and "drop that override" in line
    assert snapshot(run4) == before


def test_resume_in_process_compares_every_key(run4):
    with pytest.raises(ConfigError, match="algo.group_size was 4 in the run and is 2 now"):
        train.run(tiny_cfg("algo.group_size=2", f"resume={run4}"), run4)


# ---- 2. a fresh run never starts in a folder that holds one -----------------------------------

def test_fresh_run_refuses_a_folder_that_holds_a_run(run4):
    before = snapshot(run4)
    line = one_line_error(run_cli(["train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={run4}"]))
    assert "already holds a run" in line and f"resume={run4}" in line
    # the run's data is untouched (Hydra's own .hydra/ and train.log, and the lock's pid, are not data)
    def data(files):
        return {k: v for k, v in files.items() if not k.startswith(".hydra") and k not in (".lock", "train.log")}

    assert data(snapshot(run4)) == data(before)


# ---- 3. resuming from an older checkpoint sets the newer ones aside ---------------------------

def test_resume_from_an_older_checkpoint_moves_the_abandoned_branch_aside(run4, tmp_path):
    run = copy_run(run4, tmp_path / "run")
    train.run(tiny_cfg("trainer.max_steps=3", "trainer.save_every=1", "trainer.keep_last=null",
                       f"resume={run}/checkpoints/step_000002"), run)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step_000001", "step_000002", "step_000003"]
    aside = list((run / "checkpoints").glob("abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_000003", "step_000004"]
    # the new step 3 is the new branch's, and it is what resolve() and eval pick
    assert checkpoint.resolve(run) == run / "checkpoints" / "step_000003"


# ---- 4. one process per run folder ------------------------------------------------------------

def test_a_locked_run_folder_is_refused(run4):
    lock = RunLock(run4)
    try:
        before = snapshot(run4)
        with pytest.raises(ConfigError, match=f"in use by another grpo train \\(pid {os.getpid()}\\)"):
            train.run(tiny_cfg("trainer.max_steps=5", f"resume={run4}"), run4)
        assert snapshot(run4) == before
    finally:
        lock.release()


# ---- 5. non-finite steps are skipped, then the run stops; no NaN checkpoint ------------------

def test_nonfinite_steps_are_skipped_and_stop_the_run(tmp_path):
    with pytest.raises(RunError, match="3 steps in a row had a non-finite loss or gradient"):
        train.run(tiny_cfg("trainer.max_steps=8", "optimizer.lr=1e30", "trainer.max_grad_norm=null",
                           "trainer.save_every=1"), tmp_path)
    records = metrics(tmp_path)
    assert [r["nonfinite_skipped"] for r in records][-3:] == [1, 1, 1] and len(records) < 8
    for ckpt in checkpoint.list_checkpoints(tmp_path):  # whatever was saved is finite
        checkpoint.verify(ckpt)


def test_save_refuses_nonfinite_weights(tmp_path):
    from grpo_cli.policy import build_policy

    cfg = tiny_cfg()
    policy, _, _ = build_policy(cfg.model)
    next(p for p in policy.parameters() if p.requires_grad).data[0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        checkpoint.save(tmp_path, 1, policy, None, None, {}, cfg)
    assert not (tmp_path / "checkpoints" / "step_000001").exists()


# ---- 6. corrupt checkpoint files are named; a run folder falls back to a good one -------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _nan_weights(path: Path) -> None:
    tensors = load_file(path)
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, path)


CORRUPTIONS = [
    ("adapter_model.safetensors", _truncate),
    ("adapter_model.safetensors", _nan_weights),
    ("trainer_state.json", lambda p: p.write_text("{garbage")),
    ("optimizer.json", lambda p: p.unlink()),
    ("config.yaml", lambda p: p.write_text("a: [unclosed")),
]


@pytest.mark.parametrize("name,corrupt", CORRUPTIONS)
def test_a_corrupt_checkpoint_is_named_and_skipped(run4, tmp_path, name, corrupt):
    run = copy_run(run4, tmp_path / "run")
    newest = run / "checkpoints" / "step_000004"
    corrupt(newest / name)
    with pytest.raises(CheckpointError, match=str(newest / name)):
        checkpoint.resolve(newest)
    warned = []
    assert checkpoint.resolve(run, warn=warned.append) == run / "checkpoints" / "step_000003"
    assert len(warned) == 1 and name in warned[0]


def test_cli_resume_from_a_corrupt_checkpoint_is_one_line(run4, tmp_path):
    run = copy_run(run4, tmp_path / "run")
    _truncate(run / "checkpoints" / "step_000004" / "adapter_model.safetensors")
    line = one_line_error(run_cli(["train", f"resume={run}/checkpoints/step_000004",
                                   f"hydra.run.dir={tmp_path / 'h'}"]))
    assert "adapter_model.safetensors" in line and "cannot be read" in line


# ---- 9. prompt length -------------------------------------------------------------------------

def test_a_huge_prompt_is_refused_before_it_is_tokenized(tmp_path):
    data = tmp_path / "huge.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "2"}] * 30 + [{"question": "x" * 10_000_000, "answer": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # measured with every row before the model loads, named by its line (grpo_cli.lengths)
    with pytest.raises(ConfigError, match="huge.jsonl:31: the prompt is 10,000,0.. characters with the chat "
                                          "template, longer than sampler.max_prompt_tokens"):
        train.run(tiny_cfg("data=jsonl", f"data.path={data}", "data.heldout_size=1", "trainer.prompts_per_step=31",
                           "trainer.max_steps=1", "algo.group_size=2"), tmp_path / "run")


def test_prompt_plus_completion_must_fit_the_context(tmp_path):
    # the tiny model's context is 2048 positions
    with pytest.raises(ConfigError, match="exceed the model's context of 2048 tokens"):
        train.run(tiny_cfg("sampler.max_prompt_tokens=2045", "trainer.max_steps=1"), tmp_path)  # 2045 + 8 > 2048


# ---- 10. bad values stop before the model loads -----------------------------------------------

BAD = [
    ("trainer.lr_scheduler=bogus", "trainer.lr_scheduler"),
    ("trainer.seed=abc", "trainer.seed"),
    ("optimizer.betas=[2,3]", "optimizer.betas"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("model.lora.alpha=abc", "model.lora.alpha"),
    ("model.lora.dropout=2", "model.lora.dropout"),
    ("algo.importance_sampling_level=seq", "algo.importance_sampling_level ('seq') must be token or sequence"),
    ("algo.is_correction=sequence_mask", "algo.is_correction (sequence_mask) needs a cap"),
    ("algo.is_correction=clip", "algo.is_correction ('clip') must be token_truncate, token_mask, sequence_truncate"),
    ("algo.top_entropy_quantile=0", "algo.top_entropy_quantile (0) must be in (0, 1]"),
    ("algo.entropy_coef=abc", "algo.entropy_coef ('abc') must be a number"),
    ("algo.overlong_buffer=33", "algo.overlong_buffer (33) must be at most sampler.max_new_tokens (32)"),
    ("algo.overlong_buffer=0", "algo.overlong_buffer (0) must be an integer >= 1"),
    ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling ('maybe') must be true or false"),
    ("algo.max_generation_batches=0", "algo.max_generation_batches (0) must be an integer >= 1"),
    ("trainer.warmup_steps=-1", "trainer.warmup_steps"),
    ("trainer.gradient_checkpointing=maybe", "trainer.gradient_checkpointing"),
    ("reward.timeout_s=-1", "reward.timeout_s"),
    ("+trainer.max_step=100", "trainer.max_step is not a setting; did you mean trainer.max_steps?"),
    ("~reward.functions.accuracy._partial_", "add `_partial_: true` to reward.functions.accuracy"),
]


@pytest.mark.parametrize("override,expected", BAD)
def test_bad_value_is_caught_by_validate(override, expected):
    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["model=tiny", override]), *train.CHECKS)
    assert expected in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_is_caught():
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        validate(compose("train", ["model=tiny", "model.device=cuda"]))


@pytest.mark.parametrize("args,expected", [
    (["trainer.foo=1"], "trainer.foo is not a setting"),
    (["+recipe=nope"], "Could not find 'recipe/nope'"),
    (["model.lora.target_modules=[nope]"], "model.lora.target_modules"),
    (["trainer.lr_scheduler=bogus", "hydra.run.dir=/tmp/grpo-never-made"], "trainer.lr_scheduler"),
])
def test_cli_bad_values_are_one_line(args, expected, tmp_path):
    line = one_line_error(run_cli(["train", "model=tiny", *args, f"hydra.run.dir={tmp_path}/run"]))
    assert expected in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- 11. files a kill leaves behind -----------------------------------------------------------

def test_a_partial_last_metrics_line_does_not_stop_resume(run4, tmp_path):
    run = copy_run(run4, tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')  # a kill in the middle of a write
    train.run(tiny_cfg("trainer.max_steps=5", "trainer.save_every=1", "trainer.keep_last=null", f"resume={run}"),
              run)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_foreign_folders_under_checkpoints_are_ignored(run4, tmp_path):
    run = copy_run(run4, tmp_path / "run")
    (run / "checkpoints" / "step_000002.bak").mkdir()
    (run / "checkpoints" / "step_000002.bak" / "trainer_state.json").write_text("{}")
    (run / "checkpoints" / "step_x").mkdir()
    assert [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(run)] == [1, 2, 3, 4]


def test_truncate_jsonl_replaces_the_file_atomically(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    inode = path.stat().st_ino
    assert truncate_jsonl(path, 2) == 1  # one unreadable line dropped
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert path.stat().st_ino != inode  # a new file renamed over the old one, not rewritten in place
    assert not path.with_name("m.jsonl.tmp").exists()


# ---- 12. disk full, read-only folders, Ctrl-C during the model load ---------------------------

def test_a_read_only_run_folder_is_one_line(tmpfs):
    folder = tmpfs("ro", "size=1m,ro")
    line = one_line_error(run_cli(["train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={folder}/run"]))
    assert "read-only" in line and "hydra.run.dir=" in line


def test_a_full_disk_is_one_line_and_the_last_checkpoint_survives(tmpfs, tmp_path):
    disk = tmpfs("small", "size=512k")
    run = disk / "run"
    common = [*TINY, "trainer.save_every=1", "trainer.keep_last=null", "trainer.report_to=[]",
              "trainer.log_completions_every=null"]
    assert run_cli(["train", *common, "trainer.max_steps=2", f"hydra.run.dir={run}"]).returncode == 0
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * max(free - 8192, 0))  # leave 8 KiB: less than one checkpoint
    good = snapshot(run / "checkpoints" / "step_000002")
    # Hydra's own folder for the resumed command is elsewhere: Hydra writes it before our code runs
    line = one_line_error(run_cli(["train", f"resume={run}", "trainer.max_steps=6", f"hydra.run.dir={tmp_path}/h"]),
                          code=1)
    assert "No space left on device" in line
    assert snapshot(run / "checkpoints" / "step_000002") == good
    checkpoint.verify(run / "checkpoints" / "step_000002")


def test_disk_full_in_process_is_one_line(tmp_path, monkeypatch, capsys):
    """An OSError (here an injected ENOSPC from the checkpoint writer) ends the command in one line, exit 1."""
    import errno

    from grpo_cli.app import hydra_app

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "checkpoints"))

    monkeypatch.setattr(checkpoint, "save", full)

    @hydra_app("train")
    def app(cfg):
        train.run(cfg, tmp_path)

    monkeypatch.setattr(sys, "argv", ["grpo train", *TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        app()
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: [Errno 28] No space left on device") and "Traceback" not in "".join(err)


# ---- 13. huge rewards ---------------------------------------------------------------------------

def test_huge_rewards_still_give_advantages():
    # float32 variance of ±1e30 overflows to inf (and the advantages to 0); in float64 it does not
    rewards = torch.tensor([1e30, -1e30, 1e30, -1e30], dtype=torch.float32)
    assert torch.allclose(outcome_advantages(rewards, 4), torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)


# ---- the kill -9 test (slow suite) --------------------------------------------------------------


def test_resume_of_an_older_run_takes_todays_newer_settings():
    # a run saved before iterative.length_alarm, rm.min_auc and trainer.max_nonfinite_steps existed: resuming it
    # takes today's defaults for those (its loop reads them); a key of another group option (the hf loader's
    # model.revision under the smollm2 model) is not added
    from omegaconf import OmegaConf

    from grpo_cli.runs import resume_config

    cfg = compose("train", ["resume=somewhere"])
    saved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for section, key in (("iterative", "length_alarm"), ("rm", "min_auc"), ("trainer", "max_nonfinite_steps")):
        del saved[section][key]
    merged = resume_config(cfg, saved, overrides=["resume=somewhere"])
    assert merged.iterative.length_alarm == cfg.iterative.length_alarm == 0.25
    assert merged.rm.min_auc == cfg.rm.min_auc == 0.6
    assert merged.trainer.max_nonfinite_steps == cfg.trainer.max_nonfinite_steps
    # the hf option's keys the smollm2 option lacks (model.name_or_path, its loader's revision, ...) stay out
    hf = compose("train", ["model=hf", "model.name_or_path=x", "resume=somewhere"])
    extra = [k for k in ("name_or_path", "loader.revision")
             if OmegaConf.select(cfg.model, k, default="absent") == "absent"]
    assert extra and all(OmegaConf.select(hf.model, k, default="absent") != "absent" for k in extra)
    merged = resume_config(hf, saved, overrides=["resume=somewhere"])
    assert all(OmegaConf.select(merged.model, k, default="absent") == "absent" for k in extra)


# ---- a reward that calls sys.exit() costs its scores, not the run -------------------------------

def always_exits(prompts, completions, **_):
    sys.exit(3)


def test_a_training_run_survives_a_reward_that_exits(tmp_path):
    # the run's only other reward scores every completion 0.5 (a format pattern any text matches)
    cfg = compose("train", [*EVAL_TINY, "trainer.max_steps=2", "algo.group_size=2", "trainer.prompts_per_step=1",
                            "trainer.report_to=[]", "trainer.eval_every=null", "~reward.functions.accuracy",
                            "reward.weights=null",
                            "+reward.functions.exits={_target_:test_resume_and_run_guards.always_exits,_partial_:true}",
                            "+reward.functions.any={_target_:grpo_cli.rewards.outcome.format_reward,_partial_:true,"
                            "pattern:'(?s).*',match:0.5}"])
    train.run(cfg, tmp_path)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # both steps ran; each lost the exiting function's scores (1 failed call) and kept the other's 0.5
    assert [(m["step"], m["reward_failures"], m["reward"]) for m in metrics] == [(1, 1, 0.5), (2, 1, 0.5)]
