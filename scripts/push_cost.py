"""Bytes and seconds of one weight push, each way the policy can reach vLLM, for the default job's policy
(SmolLM2-135M-Instruct, LoRA as conf/model says): in process `sampler.weight_sync=merged` and `=adapter`, and with
`--url` a running `grpo serve`'s adapter push and full-weight push.

    .venv/bin/python scripts/push_cost.py OUT.json                                  # in process: merged, adapter
    .venv/bin/python scripts/push_cost.py OUT.json --url http://127.0.0.1:8000      # and the server's two pushes
    .venv/bin/python scripts/push_cost.py OUT.json --pushes 2 --sample 0            # a smoke check
    .venv/bin/python scripts/push_cost.py OUT.json model.lora.r=64                  # any train override
    .venv/bin/python scripts/push_cost.py OUT.json --url URL --way "server, full"   # one way (a full-weight server)

Each way starts its sampler as a run does (the engine sized for the default job, the policy's adapter pushed once,
not timed), then times `--pushes` pushes through the sampler's own push (`sync`: the fingerprint, the adapter folder
or the merged layers, the engine's load), the adapter's lora_B moved by a seeded perturbation before each (a full
policy: one norm weight), and reports the median, with the bytes the push sent (`last_push`). `--sample K` also
times K sampling calls of the default job's shape (trainer.prompts_per_step x algo.group_size, sampler.max_new_tokens,
sampled) after a push, in process only: with LoRA enabled vLLM samples differently (on a CPU its LoRA kernels are
PyTorch ops and the model runs uncompiled), so the push a way saves is weighed against what its sampling costs.

The server's full push needs a server started for full weights (`grpo serve model.finetune=full`, which sets
VLLM_SERVER_DEV_MODE=1); against a LoRA server its row holds the server's error. It replaces the server's base weights
(with the base's own, perturbed by 1e-6): start the server again before other work. Timings belong on a quiet
machine: say in the report when others were running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_cli.cli import setup_process  # noqa: E402
from grpo_cli.config import compose  # noqa: E402
from grpo_cli.instantiate import build  # noqa: E402
from grpo_cli.policy import build_policy, trains_adapter  # noqa: E402
from grpo_cli.rollout import render_prompts  # noqa: E402
from grpo_cli.rollout.sizing import Job  # noqa: E402

# the ways, in the order they run: (name, sampler overrides, model.finetune)
IN_PROCESS = [("in-process, merged", ["sampler=vllm", "sampler.weight_sync=merged"], "lora"),
              ("in-process, adapter", ["sampler=vllm", "sampler.weight_sync=adapter"], "lora")]
SERVER = [("server, adapter", ["sampler=vllm_server"], "lora"),
          ("server, full", ["sampler=vllm_server"], "full")]


def perturb(policy, g: torch.Generator) -> None:
    """Move the policy so its fingerprint changes and the next `sync` pushes: every lora_B by 1e-3-sized noise (as
    an optimizer step does), or for a full policy the final norm's weight by a relative 1e-6."""
    with torch.no_grad():
        if not trains_adapter(policy):
            norm = policy.get_decoder().norm.weight
            norm.mul_(1 + 1e-6 * torch.randn(norm.shape, generator=g))
            return
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def summary(name: str, seconds: list[float], sent: list[int], sampling: list[float]) -> dict:
    """One way's row: its pushes' median, min and max seconds, the bytes each sent (the same every push), and the
    median seconds of its sampling calls (None: not timed)."""
    return {"way": name, "pushes": len(seconds), "bytes": max(sent), "median_s": statistics.median(seconds),
            "min_s": min(seconds), "max_s": max(seconds),
            "sample_median_s": statistics.median(sampling) if sampling else None}


def job_prompts(cfg, tokenizer) -> list:
    """prompts_per_step arithmetic prompts in the chat template, about the default job's length."""
    count = cfg.trainer.prompts_per_step
    return render_prompts(tokenizer, [[{"role": "user", "content": f"What is {17 + 3 * i} + {25 + 7 * i}?"}]
                                      for i in range(count)])


def measure(name: str, overrides: list[str], finetune: str, args) -> dict:
    """Start one way's sampler, then time `args.pushes` pushes (and `args.sample` sampling calls)."""
    cfg = compose("train", [*args.overrides, *overrides, f"model.finetune={finetune}",
                            *([f"sampler.url={args.url}"] if name.startswith("server") else [])])
    policy, tokenizer, _ = build_policy(cfg.model)
    policy.eval()
    g = torch.Generator().manual_seed(0)
    perturb(policy, g)  # a moved adapter (lora_B nonzero), as after a step
    sampler = build(cfg.sampler)
    job = Job(cfg.trainer.prompts_per_step, cfg.algo.group_size, cfg.sampler.max_new_tokens)
    sampler.start(policy, cfg.sampler, job)  # the engine (or the server's check) and the first push: not timed
    if getattr(sampler, "fallback", None) is not None:
        raise SystemExit(f"{name}: vLLM fell back to HF generate (its line above says why)")
    seconds, sent, sampling = [], [], []
    prompts = job_prompts(cfg, tokenizer)
    for i in range(args.pushes):
        perturb(policy, g)
        t = time.perf_counter()
        sampler.sync(policy)
        seconds.append(time.perf_counter() - t)
        sent.append(sampler.last_push["bytes"])
        if i < args.sample and "server" not in name:
            t = time.perf_counter()
            sampler.generate(policy, tokenizer, prompts, cfg.algo.group_size,
                             generator=torch.Generator().manual_seed(i))
            sampling.append(time.perf_counter() - t)
    print(f"{name}: {statistics.median(seconds):.3f} s a push (median of {len(seconds)})", flush=True)
    return summary(name, seconds, sent, sampling)


def report(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("way", "pushes", "MiB a push", "median s", "min s", "max s", "sampling call s (median)"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["way"], "–", "–", "–", "–", "–", r["error"][:80])
            continue
        table.add_row(r["way"], str(r["pushes"]), f"{r['bytes'] / 2**20:.1f}", f"{r['median_s']:.3f}",
                      f"{r['min_s']:.3f}", f"{r['max_s']:.3f}",
                      "–" if r["sample_median_s"] is None else f"{r['sample_median_s']:.2f}")
    Console(width=max(Console().width, 120)).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON file the rows are written to")
    parser.add_argument("overrides", nargs="*", help="grpo train overrides (the default job's config otherwise)")
    parser.add_argument("--url", default=None, help="a running grpo serve: also time the server's pushes")
    parser.add_argument("--pushes", type=int, default=10, help="timed pushes per way (their median is reported)")
    parser.add_argument("--sample", type=int, default=1, help="timed sampling calls per in-process way (0: none)")
    parser.add_argument("--way", action="append", default=None,
                        help="a way to time, by its name (repeatable; default: all)")
    args = parser.parse_args()
    rows = []
    ways = IN_PROCESS + (SERVER if args.url else [])
    if args.way:
        wanted = args.way
        unknown = set(wanted) - {name for name, _, _ in ways}
        if unknown:
            sys.exit(f"--way: no way named {sorted(unknown)}; the ways are {[name for name, _, _ in ways]}")
        ways = [w for w in ways if w[0] in wanted]
    for name, overrides, finetune in ways:
        try:
            rows.append(measure(name, overrides, finetune, args))
        except Exception as err:  # a LoRA server has no full-weight endpoints: the row says so, the others stand
            if "server" not in name:
                raise
            rows.append({"way": name, "error": " ".join(str(err).split())[:300]})
    cfg = compose("train", list(args.overrides))
    settings = {"overrides": args.overrides, "pushes": args.pushes, "sample": args.sample, "url": args.url,
                "model": cfg.model.name, "lora_r": cfg.model.lora.r, "torch_threads": torch.get_num_threads(),
                "device": "cuda" if torch.cuda.is_available() else "cpu"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    report(rows, f"weight push, {cfg.model.name} LoRA r{cfg.model.lora.r}: median of {args.pushes} pushes "
                 f"({settings['device']}, {settings['torch_threads']} torch threads)")


if __name__ == "__main__":
    setup_process()  # as the grpo command does: vLLM in this process, quiet
    main()
