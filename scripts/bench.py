"""`make bench`: grpo-cli against TRL's GRPOTrainer at the same job, side by side, in one run, at two shapes.

    .venv/bin/python scripts/bench.py                          # both shapes, 2 interleaved rounds each
    .venv/bin/python scripts/bench.py --shapes arithmetic --rounds 1 --steps 3      # quicker
    .venv/bin/python scripts/bench.py --arms trl,ours,ours_hf  # HF generate beside the default sampler

The shapes (each a recipe here and the same flags for ../shared/bench/trl_bench.py): SmolLM2-135M fp32, LoRA r16 on
all 7 projections, 4 prompts x G=8, beta 0.04, the `grpo` loss, the whole batch in one micro-batch, and
  - arithmetic (`recipes/bench.yaml`): 2-digit addition prompts (~40 tokens), at most 64 new tokens;
  - gsm8k (`recipes/bench_gsm8k.yaml`): ../shared/data/gsm8k problems with data=gsm8k's instruction (~150-token
    prompts), at most 256 new tokens. TRL runs it with gradient checkpointing (`--gc`, its own default): without
    it TRL's first step outgrows this machine's 24 GB. Ours needs none (its update backs up one length bucket at a
    time, at most trainer.bucket_tokens rows x tokens).
Arms, each a fresh process per round, rounds interleaved: `trl` (in its own scratch venv, --trl-venv, made by
../shared/bench/setup_trl_venv.sh when missing; never in this project's), `ours` (`grpo train` with the sampler it
picks by default), `ours_hf` (sampler=default, HF generate), `ours_vllm` (sampler=vllm), `ours_compiled` (the
default sampler, trainer.compile=true: the update's decoder under torch.compile; its compile is in step 1, outside
s/step, and printed per round beside step 1's seconds).
  - s/step is the median over steps 2..N (step 1 warms up: allocator, vLLM's engine start), then the median over
    rounds; peak RSS is the whole process's (`wait4`), the model load and vLLM's in-process engine included.
  - The floor is measured here, not assumed: a matmul probe times the model's own linear layers at the run's
    shapes (decode: the 32 rows sampled together; training: an 8-row bucket of completions) on this process's
    threads, and the job's FLOPs (from the model config, the measured prompt and completion lengths: prefill and
    decode for the rollout; reference forward + policy forward + backward, ~3 forwards, for the update; the
    shared prompt counted once per group) divided by that rate are the seconds no implementation can beat on
    this CPU. Each arm's share of the floor = floor / its time (100% = at the floor). Attention scores and
    softmaxes are counted at matmul rate, so the floor is, if anything, too low.

Writes OUT/results.json; prints the tables. Run it on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "grpo-bench"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
PROMPTS, G = 4, 8
# each shape: our recipe, TRL's flags, its cap on new tokens, and how its prompts are worded (for the floor)
SHAPES = {
    "arithmetic": {"recipe": "bench", "trl": [], "new": 64},
    "gsm8k": {"recipe": "bench_gsm8k", "trl": ["--data", str(GSM8K), "--new", "256", "--gc"], "new": 256},
}
ARMS = {"trl": None, "ours": [], "ours_hf": ["sampler=default"], "ours_vllm": ["sampler=vllm"],
        "ours_compiled": ["trainer.compile=true"]}
NAMES = {"trl": "TRL GRPOTrainer", "ours": "ours (default sampler)", "ours_hf": "ours (HF generate)",
         "ours_vllm": "ours (vLLM)", "ours_compiled": "ours (compiled update)"}
# the line `grpo train` prints once the update is compiled (grpo_cli/compiled.py, CompiledDecoder.report)
COMPILED = re.compile(r"compiled the update in (\d+) s")


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, float]:
    """Run `cmd` (output to `log`); (wall seconds, peak RSS in GB of the process, from wait4)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start, usage.ru_maxrss / 2**20  # Linux: KiB


def trl(a, shape: str, out: Path, tag: str) -> dict:
    log = out / f"{tag}.log"
    _, rss = run([str(a.trl_venv / "bin" / "python"), str(a.trl_script), str(a.model_dir), "--steps", str(a.steps),
                  "--G", str(G), "--prompts", str(PROMPTS), *SHAPES[shape]["trl"]], log)
    result = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    return {"s_per_step": result["s_per_step_median"], "rollout_s": None, "update_s": None, "peak_rss_gb": rss,
            "mean_length": result["mean_completion_len"], "engine": "HF generate (TRL)"}


def ours(a, shape: str, out: Path, tag: str, extra: list[str]) -> dict:
    run_dir = out / "runs" / tag
    # the bench's own scratch run: a previous bench's is stale, and `grpo train` refuses a folder that holds a run
    shutil.rmtree(run_dir, ignore_errors=True)
    _, rss = run([sys.executable, "-m", "grpo_cli", "train", f"+recipe={SHAPES[shape]['recipe']}", *extra,
                  f"trainer.max_steps={a.steps}", "trainer.eval_every=null", f"hydra.run.dir={run_dir}"],
                 out / f"{tag}.log")
    first, *records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    text = (out / f"{tag}.log").read_text()
    # the engine the run's own line names ("sampler: vLLM (...)"; a model vLLM cannot serve says HF generate)
    engine = "vLLM" if "sampler: vLLM" in text else "HF generate"
    compiled = COMPILED.search(text)

    def median(key):
        return statistics.median(r[key] for r in records)

    return {"s_per_step": median("time/step_s"), "rollout_s": median("time/rollout_s"),
            "update_s": median("time/update_s"), "peak_rss_gb": rss, "engine": engine,
            "mean_length": statistics.mean(r["completions/mean_length"] for r in records),
            # step 1 (outside s/step): the warm-up, and a compiled update's compile, whose seconds the run printed
            "first_step_s": first["time/step_s"], "compile_s": float(compiled.group(1)) if compiled else None}


# ---- the machine's floor: a matmul probe at the run's shapes ------------------------------------------------

def model_shapes(config) -> dict:
    """The decoder's matmul work per token, from its config: linear layers (in, out, count) and the rest."""
    d, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    linears = [(d, heads * head_dim, layers), (d, kv, 2 * layers), (heads * head_dim, d, layers),  # q; k, v; o
               (d, inter, 2 * layers), (inter, d, layers)]                                           # gate, up; down
    return {"linears": linears, "head": (d, config.vocab_size), "attn_per_ctx": 4 * layers * heads * head_dim}


def matmul_rate(shapes: dict, rows: int, repeats: int = 5) -> float:
    """FLOP/s of this model's linear layers (LM head included) on `rows` rows, fp32, this process's threads:
    the best of `repeats` timings of one pass over every layer shape."""
    import torch

    mats = [(torch.randn(rows, i), torch.randn(o, i), n) for i, o, n in shapes["linears"]]
    mats.append((torch.randn(rows, shapes["head"][0]), torch.randn(shapes["head"][1], shapes["head"][0]), 1))
    flops = sum(2 * rows * w.shape[0] * w.shape[1] * n for _, w, n in mats)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x, w, n in mats:
            for _ in range(n):
                x @ w.T
        best = min(best, time.perf_counter() - t0)
    return flops / best


def forward_flops(shapes: dict, tokens: float, ctx: float, head: bool) -> float:
    """FLOPs of `tokens` tokens through the decoder at mean context `ctx`, the LM head on each if `head`."""
    linear = sum(2 * i * o * n for i, o, n in shapes["linears"])
    lm_head = 2 * shapes["head"][0] * shapes["head"][1] if head else 0
    return tokens * (linear + shapes["attn_per_ctx"] * ctx + lm_head)


def floor_probe(shape: str) -> dict:
    """The model's shapes, the mean chat-templated prompt length of the shape's prompts, and the matmul rates at
    decode rows (the 32 sampled together) and training rows (an 8-row bucket of completions)."""
    import random

    import torch

    from grpo_cli.cli import setup_process
    from grpo_cli.policy import load_embedded_gguf
    from grpo_cli.rollout import encode_prompts, render_prompts

    setup_process()
    model, tokenizer = load_embedded_gguf()
    if shape == "gsm8k":
        with GSM8K.open() as f:
            questions = [json.loads(next(f))["question"] + "\nSolve step by step, then give the final answer on the "
                         "last line as '#### N'." for _ in range(64)]
    else:
        rng = random.Random(0)
        questions = [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Give the final answer after ####."
                     for _ in range(64)]
    # as the trainer renders and encodes them: [64, P] left-padded, mask 1 on real tokens
    _, mask = encode_prompts(tokenizer, render_prompts(tokenizer, [[{"role": "user", "content": q}]
                                                                   for q in questions]))
    prompt = mask.sum(1).float().mean().item()
    shapes = model_shapes(model.config)
    del model
    with torch.no_grad():
        decode = matmul_rate(shapes, PROMPTS * G)
        training = matmul_rate(shapes, 8 * SHAPES[shape]["new"] * 3 // 4)
    return {"prompt_tokens": prompt, "shapes": shapes, "decode_flops_s": decode, "training_flops_s": training,
            "threads": torch.get_num_threads()}


def round_ratios(by_arm: dict[str, list[dict]], key: str = "s_per_step") -> dict[str, list[float]]:
    """Each arm's `key` over TRL's in the same round (the rounds are interleaved, so a round's arms ran side by
    side): {arm: [round 1, round 2, ...]}, TRL left out; {} without a TRL arm."""
    trl = by_arm.get("trl")
    if not trl:
        return {}
    return {arm: [mine[key] / theirs[key] for mine, theirs in zip(runs, trl)]
            for arm, runs in by_arm.items() if arm != "trl"}


def floors(probe: dict, completion: float) -> dict:
    """Seconds no implementation beats on this machine for one step with mean completion length `completion`."""
    s, p, n = probe["shapes"], probe["prompt_tokens"], PROMPTS * G
    prefill = forward_flops(s, PROMPTS * p, p / 2, head=False)  # each prompt once (prefix shared by its group)
    decode = forward_flops(s, n * completion, p + completion / 2, head=True)
    rollout = prefill / probe["training_flops_s"] + decode / probe["decode_flops_s"]
    update = 3 * (prefill + decode) / probe["training_flops_s"]  # reference forward, policy forward, backward
    return {"rollout_s": rollout, "update_s": update, "step_s": rollout + update,
            "rollout_tok_s": n * completion / rollout, "update_tok_s": n * (p + completion) / update}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="arithmetic,gsm8k", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--arms", default="trl,ours", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per run; the median is over steps 2..N")
    ap.add_argument("--trl-venv", type=Path, default=CACHE / "trlvenv")
    ap.add_argument("--model-dir", type=Path, default=CACHE / "smollm2-135m", help="SmolLM2 safetensors for TRL")
    ap.add_argument("--trl-setup", type=Path, default=REPO.parent / "shared" / "bench" / "setup_trl_venv.sh")
    ap.add_argument("--trl-script", type=Path, default=REPO.parent / "shared" / "bench" / "trl_bench.py")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    a = ap.parse_args()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(arms) - set(ARMS))
    if unknown:
        sys.exit(f"unknown shape or arm {', '.join(unknown)}: shapes are {', '.join(SHAPES)}, arms {', '.join(ARMS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    if "trl" in arms:
        if not a.trl_script.exists():
            sys.exit(f"no TRL driver at {a.trl_script}: pass --trl-script, or leave trl out of --arms")
        if not (a.trl_venv / "bin" / "python").exists() or not (a.model_dir / "model.safetensors").exists():
            print(f"making TRL's scratch venv {a.trl_venv} (once) ...", flush=True)
            subprocess.run(["bash", str(a.trl_setup), str(a.trl_venv), str(a.model_dir)], check=True)

    probes = {}
    for shape in shapes:
        probes[shape] = floor_probe(shape)
        print(f"{shape}: prompts {probes[shape]['prompt_tokens']:.0f} tokens; matmul probe "
              f"{probes[shape]['decode_flops_s'] / 1e9:.0f} GFLOP/s at decode rows, "
              f"{probes[shape]['training_flops_s'] / 1e9:.0f} GFLOP/s at training rows", flush=True)

    results: dict[str, dict[str, list[dict]]] = {shape: {arm: [] for arm in arms} for shape in shapes}
    for shape in shapes:
        for r in range(a.rounds):
            for arm in arms:
                tag = f"{shape}_{arm}_r{r + 1}"
                res = trl(a, shape, a.out, tag) if arm == "trl" else ours(a, shape, a.out, tag, ARMS[arm])
                results[shape][arm].append(res)
                print(f"{shape} round {r + 1} {NAMES[arm]} [{res['engine']}]: {res['s_per_step']:.1f} s/step, "
                      f"{res['peak_rss_gb']:.1f} GB, {res['mean_length']:.0f} tokens a completion"
                      + (f"; step 1 {res['first_step_s']:.0f} s" if res.get("first_step_s") else "")
                      + (f", compile {res['compile_s']:.0f} s" if res.get("compile_s") else ""), flush=True)

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    summary = {shape: {arm: {k: (med([x[k] for x in runs]) if k != "engine" else runs[0][k]) for k in runs[0]}
                       for arm, runs in by_arm.items()} for shape, by_arm in results.items()}
    for shape, by_arm in summary.items():
        for s in by_arm.values():
            s["floor"] = floors(probes[shape], s["mean_length"])
    # s/step and peak RSS over TRL's, round by round: the spread the medians hide
    ratios = {shape: {key: round_ratios(by_arm, key) for key in ("s_per_step", "peak_rss_gb")}
              for shape, by_arm in results.items()}
    (a.out / "results.json").write_text(json.dumps({"rounds": results, "median": summary, "ratios": ratios,
                                                    "probes": probes, "steps": a.steps}, indent=1))
    from rich.console import Console
    from rich.table import Table

    def fmt(v, digits=1, pct=False):
        return "–" if v is None else f"{v:.0%}" if pct else f"{v:.{digits}f}"

    console = Console(width=max(Console().width, 190))  # 14 columns: uncut in a log too
    for shape, by_arm in summary.items():
        vs = by_arm.get("trl")
        table = Table(title=f"{shape}: 4 prompts x G=8, <= {SHAPES[shape]['new']} new tokens, SmolLM2-135M fp32 + "
                            f"LoRA r16, beta 0.04; median of steps 2-{a.steps}, then of {a.rounds} interleaved "
                            f"round(s)")
        for col in ("", "sampler", "s/step", "vs TRL", "peak RSS GB", "vs TRL", "completion", "rollout s",
                    "rollout tok/s", "floor share", "update s", "update tok/s", "floor share", "step floor share"):
            table.add_column(col, justify="right")
        for arm, s in by_arm.items():
            f = s["floor"]
            completion_tokens = PROMPTS * G * s["mean_length"]
            all_tokens = PROMPTS * G * (probes[shape]["prompt_tokens"] + s["mean_length"])
            table.add_row(NAMES[arm], s["engine"], fmt(s["s_per_step"]),
                          fmt(s["s_per_step"] / vs["s_per_step"], 2) if vs else "–", fmt(s["peak_rss_gb"], 2),
                          fmt(s["peak_rss_gb"] / vs["peak_rss_gb"], 2) if vs else "–", fmt(s["mean_length"], 0),
                          fmt(s["rollout_s"]), fmt(s["rollout_s"] and completion_tokens / s["rollout_s"], 0),
                          fmt(s["rollout_s"] and f["rollout_s"] / s["rollout_s"], pct=True), fmt(s["update_s"]),
                          fmt(s["update_s"] and all_tokens / s["update_s"], 0),
                          fmt(s["update_s"] and f["update_s"] / s["update_s"], pct=True),
                          fmt(f["step_s"] / s["s_per_step"], pct=True))
        console.print(table)
        for arm, by_round in ratios[shape]["s_per_step"].items():
            console.print(f"{NAMES[arm]} / TRL by round: s/step "
                          + ", ".join(f"{r:.2f}" for r in by_round) + "; peak RSS "
                          + ", ".join(f"{r:.2f}" for r in ratios[shape]["peak_rss_gb"][arm]))
        p = probes[shape]
        console.print(f"floor ({shape}): matmul probe {p['decode_flops_s'] / 1e9:.0f} GFLOP/s at decode rows, "
                      f"{p['training_flops_s'] / 1e9:.0f} at training rows ({p['threads']} threads); prompts "
                      f"{p['prompt_tokens']:.0f} tokens; floor tok/s: rollout "
                      + ", ".join(f"{NAMES[arm]} {s['floor']['rollout_tok_s']:.0f}" for arm, s in by_arm.items())
                      + "; update " + ", ".join(f"{s['floor']['update_tok_s']:.0f}" for s in by_arm.values()))
    console.print(f"results: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
