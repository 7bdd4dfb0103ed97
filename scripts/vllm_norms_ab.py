"""Time vLLM's `generate` with its own RMSNorms against the fused CPU kernels (rollout/vllm_kernels.py), paired.

    .venv/bin/python scripts/vllm_norms_ab.py                     # the bench's 64-token shape, 4 rounds
    .venv/bin/python scripts/vllm_norms_ab.py --new 256 --rounds 3

One engine, the vLLM sampler's own (`VLLMSampler.start`, sized for the job), on the embedded SmolLM2-135M with
a LoRA adapter; 4 random prompts of `--prompt` tokens x n=8 at temperature 1. Rounds alternate the two
ways (the modules' forward swapped in place), each round with its own sampling seeds, the same for both ways,
so both draw the same completions when the numerics agree: the script prints how many did, the largest
log-prob gap over them, and each way's seconds. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=64, help="new tokens a completion")
    ap.add_argument("--prompt", type=int, default=47, help="tokens a prompt (the bench's arithmetic prompts: 47)")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()

    from grpo_cli.cli import setup_process

    setup_process()  # as the CLI: the libraries quiet, the engine in this process
    import functools

    import torch
    from vllm import SamplingParams

    from grpo_cli.config import compose
    from grpo_cli.instantiate import build
    from grpo_cli.policy import apply_lora, load_embedded_gguf
    from grpo_cli.rollout.sizing import Job
    from grpo_cli.rollout.vllm_kernels import fused_cpu_norms

    model, _ = load_embedded_gguf()
    policy = apply_lora(model, 16, 32, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    # sampler=vllm as a command composes it; eager: the fused norms are an eager engine's (a compiled one has
    # inductor's)
    section = compose("train", ["sampler=vllm", f"sampler.max_new_tokens={a.new}",
                                f"sampler.max_prompt_tokens={a.prompt}", "sampler.enforce_eager=true"]).sampler
    sampler = build(section)
    sampler.start(policy, section, Job(4, 8, a.new))  # the engine as grpo train starts it
    llm = sampler.llm
    # vLLM's own forward of each norm the engine put on the kernels (the partial's second argument), by name
    def own(module):
        method = getattr(module, "_forward_method", None)
        return method.args[1] if isinstance(method, functools.partial) and method.func.__name__ == "_fused" else None

    vllms = llm.apply_model(lambda m: {n: own(x) for n, x in m.named_modules() if own(x) is not None})[0]
    print(f"{len(vllms)} norms on the fused kernels at the engine's start")

    def use(fused: bool) -> None:
        def swap(model):
            for name, module in model.named_modules():
                if name in vllms:
                    module._forward_method = vllms[name]
            if fused:
                fused_cpu_norms(model)
        llm.apply_model(swap)

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 20000, (a.prompt,), generator=g).tolist()} for _ in range(4)]

    def generate(seed: int):
        params = [SamplingParams(n=8, max_tokens=a.new, logprobs=0, ignore_eos=True, detokenize=False, seed=seed + i,
                                 temperature=1.0) for i in range(len(prompts))]
        llm.reset_prefix_cache()  # each round prefills its prompts, as after a weight push
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        samples = [s for o in out for s in o.outputs]
        return seconds, [s.token_ids for s in samples], [[lp[t].logprob for t, lp in zip(s.token_ids, s.logprobs)]
                                                         for s in samples]

    use(False)
    generate(0)  # warm-up
    seconds = {False: [], True: []}
    same, gap, total = 0, 0.0, 0
    for r in range(a.rounds):
        runs = {}
        for fused in (False, True):
            use(fused)
            runs[fused] = generate(100 * (r + 1))
            seconds[fused].append(runs[fused][0])
        for (ta, la), (tb, lb) in zip(zip(*runs[False][1:]), zip(*runs[True][1:])):
            total += 1
            same += ta == tb
            agree = next((i for i, (p, q) in enumerate(zip(ta, tb)) if p != q), min(len(ta), len(tb)))
            gap = max([gap] + [abs(x - y) for x, y in zip(la[:agree], lb[:agree])])  # over the common prefix
    for fused, name in ((False, "vLLM's own norms"), (True, "fused kernels")):
        runs_s = " ".join(f"{s:.2f}" for s in seconds[fused])
        print(f"{name:17s} {runs_s} s  (median {statistics.median(seconds[fused]):.2f})")
    print(f"the same completions: {same}/{total}; largest log-prob gap over each pair's common prefix: {gap:.2e}")


if __name__ == "__main__":
    main()
