"""`grpo` under torchrun, 2 ranks on the tiny model: data parallel and FSDP train, resume and eval as one process
does; with vLLM, an engine per rank. Each case starts its own processes: the process is the subject."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batches import G
from tests.helpers.cli import run_cli
from tests.helpers.engines import needs_vllm
from tests.helpers.ranks import TORCHRUN_TINY, torchrun
from tests.helpers.tools import SCRIPTED_TOOLS, SCRIPTED_TOOLS_ARGS


@pytest.mark.slow
@pytest.mark.ci
def test_torchrun_eval_shards_problems_and_gathers_every_row(tmp_path):

    args = ["eval", "model=tiny", "eval.limit=6", "eval.batch_size=2", "eval.max_new_tokens=6"]
    torchrun(tmp_path, *args, f"hydra.run.dir={tmp_path / 'two'}")
    # one process: this one (run_cli), with the ranks' one thread, so the greedy argmax sees the same sums
    code, _, err = run_cli([*args, f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path, threads=1)
    assert code == 0, err[-3000:]
    rows = {}
    for name in ("one", "two"):
        lines = [json.loads(line) for line in (tmp_path / name / "eval_samples.jsonl").read_text().splitlines()]
        rows[name] = sorted((r["index"], r["greedy"]["text"]) for r in lines)
    # every problem once, and the same greedy completions as one process
    assert [i for i, _ in rows["two"]] == list(range(6))
    assert rows["two"] == rows["one"]
    report = [json.loads((tmp_path / name / "eval.json").read_text())["results"][0] for name in ("one", "two")]
    assert report[0]["accuracy"] == report[1]["accuracy"]


@pytest.mark.slow
@pytest.mark.ci
def test_torchrun_two_ranks_train_episodes_resume_them_exactly_after_kill_9_and_eval(tmp_path):
    """One launch of each: a 2-rank run (multi-turn episodes, the scripted tool calls), the same run killed (-9)
    after its first checkpoint and resumed on 2 ranks, and grpo eval of the 2-rank checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "scripted_tools.py").write_text(SCRIPTED_TOOLS)
    args = ["train", *TORCHRUN_TINY, *SCRIPTED_TOOLS_ARGS, "trainer.max_steps=2"]
    torchrun(tmp_path, *args)
    runs = list((tmp_path / "outputs" / "train").glob("*/*"))
    assert len(runs) == 1, runs  # both ranks wrote into the one folder rank 0's clock named
    straight = runs[0]
    rows = [json.loads(line) for line in (straight / "completions.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for record in metrics:
        mine = [r for r in rows if r["step"] == record["step"]]
        # both ranks' episodes, with their turns; the metrics are over all 16 (4 prompts x G), not rank 0's 8
        assert len(mine) == 16 and {r["rank"] for r in mine} == {0, 1} and all(r["turns"] for r in mine)
        prompts = {rank: {r["prompt_id"] for r in mine if r["rank"] == rank} for rank in (0, 1)}
        assert len(prompts[0]) == len(prompts[1]) == 2 and not prompts[0] & prompts[1]  # no prompt twice
        texts = {rank: [r["completion"] for r in mine if r["rank"] == rank] for rank in (0, 1)}
        assert texts[0] != texts[1]  # each rank sampled its own episodes
        assert record["tools/call_frequency"] == pytest.approx(sum(r["tool_calls"] for r in mine) / 16)
        turns = [sum(m["role"] == "assistant" for m in r["turns"]) for r in mine]
        assert record["turns/mean"] == pytest.approx(sum(turns) / 16)
    assert any(r["tool_calls"] for r in rows)

    # the same run killed (-9, every process) once its first checkpoint is written, then resumed on 2 ranks
    bin_dir = Path(sys.executable).parent
    killed = tmp_path / "killed"
    proc = subprocess.Popen([str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node=2", str(bin_dir / "grpo"),
                             *args, f"hydra.run.dir={killed}"], cwd=tmp_path, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "step_000001").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None  # killed mid-run: step 2 had not ended
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    torchrun(tmp_path, "train", f"resume={killed}", "trust_run_config=true")
    # the episodes of every step are the uninterrupted run's, token for token, and so are the weights
    assert (killed / "completions.jsonl").read_text() == (straight / "completions.jsonl").read_text()
    final, again = _adapter(straight, 2), _adapter(killed, 2)
    assert final.keys() == again.keys()
    for name in final:
        assert torch.allclose(final[name], again[name], atol=1e-6, rtol=0), name
    assert len((killed / "metrics.jsonl").read_text().splitlines()) == 2

    # grpo eval loads the 2-rank checkpoint (one process: this one, as run_cli runs a command); the run's sampler
    # is the scripted one of this folder, code a run folder does not run unless trusted
    code, out, err = run_cli(["eval", f"checkpoint={straight / 'checkpoints' / 'step_000002'}", "eval.limit=4",
                              "trust_run_config=true", f"hydra.run.dir={tmp_path / 'eval'}"], cwd=tmp_path)
    assert code == 0 and (tmp_path / "eval" / "eval.json").exists(), err[-3000:]


def _adapter(run: Path, step: int) -> dict:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "adapter_model.safetensors"))


def _run(folder: Path, *args: str, ranks: int = 2):
    folder.mkdir(exist_ok=True)
    done = torchrun(folder, "train", *TORCHRUN_TINY, *args, ranks=ranks)
    return done, next((folder / "outputs" / "train").glob("*/*"))


# slow, not in CI: the 2-rank equivalence and memory tests above cover FSDP there (the suite's 10 minutes)
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["buckets", "gradient_checkpointing"])
def test_torchrun_fsdp_trains_as_data_parallel_saves_and_resumes_in_one_process(tmp_path, checkpointing):
    """3 steps on 2 ranks with the base sharded: the same completions and adapter as data parallelism alone
    (sampling on the gathered base, the update in lockstep, a checkpoint each step by rank 0); then step 3 again
    from step 2's checkpoint in one process, where trainer.fsdp does nothing."""
    extra = [f"trainer.gradient_checkpointing={str(checkpointing).lower()}"]
    done, sharded = _run(tmp_path / "fsdp", "trainer.fsdp=true", *extra)
    assert "fsdp: base sharded over 2 ranks, 0.0455 MB of 0.0909 MB per rank" in done.stderr
    _, plain = _run(tmp_path / "dp", *extra)
    assert (sharded / "completions.jsonl").read_text().replace(sharded.name, "") == \
        (plain / "completions.jsonl").read_text().replace(plain.name, "")
    final, expected = _adapter(sharded, 3), _adapter(plain, 3)
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.allclose(final[name], expected[name], atol=1e-6, rtol=0), name
    if checkpointing:
        return
    # step 3 again from step 2 on 2 ranks (the adapter loaded into the sharded policy): the same weights
    torchrun(tmp_path / "fsdp", "train", f"resume={sharded / 'checkpoints' / 'step_000002'}")
    again = _adapter(sharded, 3)
    for name in final:
        assert torch.allclose(again[name], final[name], atol=1e-6, rtol=0), name
    # and in one process (other sampling seeds for rank 1's prompts, so other weights: it runs, that is all)
    done = torchrun(tmp_path / "fsdp", "train", f"resume={sharded / 'checkpoints' / 'step_000002'}", ranks=1)
    assert "fsdp: one process, nothing to shard" in done.stderr
    assert len((sharded / "metrics.jsonl").read_text().splitlines()) == 3


# the embedded SmolLM2 sampled by vLLM, small: 4 prompts x G (4) = 16 completions of at most 16 tokens a step
VLLM_SMALL = ["sampler=vllm", "sampler.max_new_tokens=16", "sampler.max_prompt_tokens=256",
              "sampler.max_model_len=512", "sampler.cpu_kv_cache_gb=0.25"]


@needs_vllm
@pytest.mark.slow  # 63 s quiet (154 s in a CI run): make test-all, not CI, which keeps make test under 10 minutes
def test_torchrun_train_and_eval_with_an_engine_per_rank(tmp_path):

    torchrun(tmp_path, "train", *VLLM_SMALL, f"algo.group_size={G}", "trainer.prompts_per_step=4",
          "trainer.micro_batch_size=8", "trainer.max_steps=2", "trainer.save_every=2", "trainer.report_to=[]",
          "trainer.log_completions_every=1", "trainer.num_completions_to_print=0")
    runs = list((tmp_path / "outputs" / "train").glob("*/*"))
    assert len(runs) == 1, runs  # both ranks wrote into the one folder
    run = runs[0]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    saved = (run / "checkpoints" / "step_000002" / "config.yaml").read_text()
    assert "grpo_cli.rollout.vllm.VLLMSampler" in saved  # vLLM sampled (no fallback to HF generate)
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [r for r in rows if r["step"] == step]
        assert len(mine) == 16 and {r["rank"] for r in mine} == {0, 1}  # completions of both ranks' engines
        prompts = {rank: {r["prompt_id"] for r in mine if r["rank"] == rank} for rank in (0, 1)}
        assert len(prompts[0]) == len(prompts[1]) == 2 and not prompts[0] & prompts[1]

    # greedy eval of the checkpoint: vLLM on 2 ranks (5 problems: 3 on rank 0 in 2 batches, 2 on rank 1 in 1, so
    # the engines must not wait on each other) equals HF generate in one process
    ckpt = run / "checkpoints" / "step_000002"
    args = ["eval", f"checkpoint={ckpt}", "eval.limit=5", "eval.batch_size=2", "eval.max_new_tokens=16"]
    torchrun(tmp_path, *args, *VLLM_SMALL, f"hydra.run.dir={tmp_path / 'vllm'}")
    torchrun(tmp_path, *args, "sampler=default", f"hydra.run.dir={tmp_path / 'hf'}", ranks=1)
    texts = {}
    for name in ("vllm", "hf"):
        lines = [json.loads(line) for line in (tmp_path / name / "eval_samples.jsonl").read_text().splitlines()]
        texts[name] = sorted((r["index"], r["greedy"]["text"]) for r in lines)
        report = json.loads((tmp_path / name / "eval.json").read_text())
        assert report["config"]["sampler"]["_target_"].split(".")[-1] == {"vllm": "VLLMSampler",
                                                                          "hf": "HFSampler"}[name]
    assert [i for i, _ in texts["vllm"]] == list(range(5))  # every problem once
    assert texts["vllm"] == texts["hf"]


@needs_vllm
@pytest.mark.slow
def test_torchrun_model_vllm_cannot_serve_falls_back_on_every_rank_and_trains(tmp_path):
    # the tiny model's head size (8) is one vLLM's CPU attention lacks: each rank's engine starts, fails its
    # one-token check, and the rank samples with HF generate; the trainer's process group must survive that
    done = torchrun(tmp_path, "train", "model=tiny", *VLLM_SMALL, f"algo.group_size={G}", "trainer.prompts_per_step=4",
                 "trainer.max_steps=2", "trainer.report_to=[]")
    warnings = [line for line in (done.stdout + done.stderr).splitlines() if "vLLM cannot serve" in line]
    assert len(warnings) == 1 and "head_dim=8" in warnings[0], warnings  # rank 0 speaks, once
    run = next((tmp_path / "outputs" / "train").glob("*/*"))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert "grpo_cli.rollout.hf.HFSampler" in (run / "checkpoints" / "step_000002" / "config.yaml").read_text()

