"""Rollout speed of sampler=default (HF generate) and sampler=vllm on the embedded SmolLM2, side by side.

    .venv-vllm/bin/python scripts/sampler_speed.py                 # 4 prompts x G=8 x 64 new tokens, 3 rounds
    .venv-vllm/bin/python scripts/sampler_speed.py --rounds 5 --group-size 16

The policy is the default job's (SmolLM2-135M fp32 + LoRA r16 on all 7 projections) with random nonzero LoRA
weights, as after training. Each round draws the next prompts of the arithmetic stream and samples them with
both engines, alternating which goes first; before each vLLM rollout the adapter changes and is pushed
(`sync`), as in training, and that push is timed apart. Prints one line per round and a summary (median tok/s,
engine start-up); completions stop at EOS, so tok/s counts the tokens actually sampled. Benchmarks belong on
a quiet machine: say so when others were running.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_cli.cli import setup_process  # noqa: E402
from grpo_cli.config import compose  # noqa: E402
from grpo_cli.data import PromptStream  # noqa: E402
from grpo_cli.instantiate import build  # noqa: E402
from grpo_cli.policy import build_policy  # noqa: E402
from grpo_cli.rollout import render_prompts  # noqa: E402


def randomize_adapter(policy, seed: int, scale: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    cfg = compose("train")
    policy, tokenizer, _ = build_policy(cfg.model)
    policy.eval()
    stream = PromptStream(build(cfg.data).train, 0)
    tokens = f"sampler.max_new_tokens={args.max_new_tokens}"
    engines = {"hf": build(compose("train", ["sampler=default", tokens]).sampler),
               "vllm": build(compose("train", ["sampler=vllm", tokens]).sampler)}
    randomize_adapter(policy, 0)
    t0 = time.perf_counter()
    engines["vllm"].sync(policy)  # starts the engine and pushes the adapter
    print(f"vllm engine start + first push: {time.perf_counter() - t0:.1f} s", flush=True)
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    pushes = []
    for r in range(args.rounds):
        prompts = render_prompts(tokenizer, [e["messages"] for e in stream.next(args.prompts)])
        randomize_adapter(policy, r + 1)
        order = ["hf", "vllm"] if r % 2 == 0 else ["vllm", "hf"]
        line = [f"round {r + 1}:"]
        for name in order:
            sampler = engines[name]
            torch.manual_seed(r)
            t0 = time.perf_counter()
            sampler.sync(policy)
            pushed = time.perf_counter() - t0
            rollout = sampler.generate(policy, tokenizer, prompts, args.group_size)
            elapsed = time.perf_counter() - t0
            count = sum(rollout.lengths)
            rates[name].append(count / elapsed)
            extra = ""
            if name == "vllm":
                pushes.append(pushed)
                extra = f" (push {pushed:.2f} s included)"
            line.append(f"{name} {count} tok in {elapsed:.1f} s = {count / elapsed:.0f} tok/s{extra};")
        print(" ".join(line), flush=True)
    hf, vl = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
    push = statistics.median(pushes)
    print(f"median: hf {hf:.0f} tok/s, vllm {vl:.0f} tok/s ({vl / hf:.2f}x), vllm push {push:.2f} s"
          f" | {args.prompts} prompts x G={args.group_size} x <= {args.max_new_tokens} tokens, "
          f"torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    setup_process()  # as the grpo command does: vLLM in this process, quiet
    main()
