"""Profile one GRPO step of `grpo train` with torch.profiler: where the rollout's and the update's time goes.

    .venv/bin/python scripts/profile_step.py                            # the bench job (64 new tokens)
    .venv/bin/python scripts/profile_step.py --shape gsm8k              # the GSM8K shape (256 new tokens)
    .venv/bin/python scripts/profile_step.py -- sampler=default         # extra `grpo train` overrides after --

Runs `grpo train` in this process for `--steps` steps (the bench recipe, `recipes/bench.yaml` or
`recipes/bench_gsm8k.yaml`) and profiles the last one: the trainer's own `prepare` (reference forward) and
`update` (forward, backward, optimizer step) are wrapped, nothing in the product changes. Prints, per phase,
the wall time and the top operators by self CPU time with their share of the phase, and the share that
matrix multiplies (aten::mm/addmm/bmm/matmul/linear kernels) take: the rest is what is worth acting on.
Run it on a quiet machine; the shares hold under load better than the seconds do.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

# operators whose self time is matrix-multiply work (oneDNN / MKL kernels under them report as these)
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("bench", "gsm8k"), default="bench")
    ap.add_argument("--steps", type=int, default=2, help="steps to run; the last one is profiled")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("overrides", nargs="*", help="more `grpo train` overrides (after --)")
    a = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from grpo_cli.cli import setup_process

    setup_process()  # as the CLI does first: the libraries quiet, the allocator set
    import grpo_cli.commands.train as train_cmd

    phases: dict[str, list] = defaultdict(list)  # phase -> [(wall s, profiler)] of each call in the last step
    calls = {"update": 0}

    def profiled(name, fn):
        def run(*args, **kwargs):
            last = calls["update"] >= a.steps - 1  # the steps before the last warm up
            if not last:
                if name == "update":
                    calls["update"] += 1
                return fn(*args, **kwargs)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                wall = time.perf_counter() - t0
            phases[name].append((wall, prof))
            if name == "update":
                calls["update"] += 1
            return out
        return run

    train_cmd.prepare = profiled("prepare (reference forward)", train_cmd.prepare)
    train_cmd.update = profiled("update", train_cmd.update)
    recipe = "bench" if a.shape == "bench" else "bench_gsm8k"
    sys.argv = ["grpo", "train", f"+recipe={recipe}", f"trainer.max_steps={a.steps}", "trainer.report_to=[]",
                "hydra.run.dir=outputs/profile/${now:%Y-%m-%d_%H-%M-%S}", *a.overrides]
    from grpo_cli.cli import main as cli_main

    try:
        cli_main()
    except SystemExit as done:
        if done.code not in (0, None):
            raise

    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for name, runs in phases.items():
        wall = sum(w for w, _ in runs)
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for _, prof in runs:
            for ev in prof.key_averages():
                totals[ev.key] += ev.self_cpu_time_total / 1e6
                counts[ev.key] += ev.count
        busy = sum(totals.values())
        matmul = sum(v for k, v in totals.items() if k in MATMUL)
        table = Table(title=f"{name}: {wall:.2f} s wall, {busy:.2f} s of operator self time; matrix multiplies "
                            f"{matmul / max(busy, 1e-9):.0%}")
        for col in ("operator", "self s", "share", "calls"):
            table.add_column(col, justify="right" if col != "operator" else "left")
        for key, secs in sorted(totals.items(), key=lambda kv: -kv[1])[:a.top]:
            table.add_row(key, f"{secs:.2f}", f"{secs / max(busy, 1e-9):.1%}", str(counts[key]))
        console.print(table)


if __name__ == "__main__":
    main()
