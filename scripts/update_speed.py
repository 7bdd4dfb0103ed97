"""Time one GRPO update's forwards and backward at the bench shapes: the whole-sequence path vs the shared-prefix one,
or (--compile) the shared-prefix path eager vs compiled (trainer.compile, grpo_cli/compiled.py).

    .venv/bin/python scripts/update_speed.py                 # 2 rounds, each path in its own process per round
    .venv/bin/python scripts/update_speed.py --rounds 3 --prompts 4 --G 8 --new 64
    .venv/bin/python scripts/update_speed.py --compile --shape arithmetic    # eager vs compiled, profiles of each
    .venv/bin/python scripts/update_speed.py --compile --shape gsm8k
    .venv/bin/python scripts/update_speed.py --compile --tiny --rounds 1   # the tiny random model: checks the script

The batch is the bench's (`make bench`): SmolLM2-135M fp32, LoRA r16 on all 7 projections, `--prompts` 2-digit
addition prompts x G completions of ~51 tokens (random tokens, lengths drawn around the bench's mean, at most
`--new`), one micro-batch. Each path runs in a fresh process (so its peak RSS is its own), rounds interleaved;
per path: the reference forward (adapter off, no gradient), then the policy's forward (log-probs + entropy)
and backward of a GRPO-like loss (the shared path, as the trainer runs it, backs up each length bucket as soon
as it is scored, so the two are timed together), median over steps 2-4 of the process, then over rounds.
`--shape gsm8k`: the first `--prompts` GSM8K questions (../shared/data/gsm8k/train.jsonl) and completions of
~210 tokens, at most 256 (the bench's GSM8K shape). With --compile the first step's time holds the compile, which
is printed on its own (dynamo's timers), and one more step runs under torch.profiler: its top-10 operators by
self time, per mode, and its self time split by class (`classes`: the base projections', the LM head's and LoRA's
matrix multiplies told apart by their shapes, attention forward and backward, everything else).
Run it on a quiet machine. Beside the wall seconds, each step's CPU seconds
(`time.process_time`: all of the process's threads), the steadier number on a shared machine. The children compile
in-process (TORCHINDUCTOR_COMPILE_THREADS=1) and cold (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: a run's first
compile, not a hit in inductor's disk cache), each unless set, so the compile's CPU seconds are the process's: read
as the compiled first step's excess over eager's; `graphs` counts what dynamo compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PATHS = ("full", "shared")
MODES = ("eager", "compiled")  # --compile: the shared path both ways
GSM8K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _questions(shape: str, prompts: int, rng: random.Random) -> list[str]:
    if shape == "gsm8k":
        return [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:prompts]]
    return [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Give the final answer after ####."
            for _ in range(prompts)]


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
RANK = 16  # the bench's LoRA rank


def classes(events, vocab: int, rank: int) -> dict[str, float]:
    """Self seconds of profiler `events` (name, input shapes, self µs) by class: a matrix multiply with a dimension of
    `vocab` is the LM head's, one with a dimension of `rank` LoRA's, any other the base projections'; `attention` is
    SDPA forward and backward; `other` the rest; `total` all."""
    out = dict.fromkeys(("base", "head", "lora", "attention", "other", "total"), 0.0)
    for name, shapes, self_us in events:
        dims = {d for shape in shapes for d in (shape or ())}
        if name in MATMULS:
            kind = "head" if vocab in dims else "lora" if rank in dims else "base"
        else:
            kind = "attention" if "scaled_dot_product" in name else "other"
        out[kind] += self_us / 1e6
        out["total"] += self_us / 1e6
    return out


def measure(path: str, prompts: int, G: int, new: int, shape: str = "arithmetic", tiny: bool = False) -> dict:
    import torch

    from grpo_cli import compiled
    from grpo_cli import logprobs as L
    from grpo_cli import rollout as R
    from grpo_cli.cli import setup_process
    from grpo_cli.policy import apply_lora, load_embedded_gguf, load_tiny_random, reference

    setup_process()  # as the CLI does at start-up
    torch.manual_seed(0)
    model, tokenizer = load_tiny_random() if tiny else load_embedded_gguf()
    policy = apply_lora(model, RANK, 32, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    decoder = compiled.CompiledDecoder(policy.get_base_model().get_decoder(), say=print) if path == "compiled" \
        else None
    rng = random.Random(0)
    conversations = [[{"role": "user", "content": q}] for q in _questions(shape, prompts, rng)]
    ids, mask = R.encode_prompts(tokenizer, R.render_prompts(tokenizer, conversations))  # [B, P]
    n = prompts * G
    mean, spread = (210, 40) if shape == "gsm8k" else (51.5, 12)  # the bench's completion lengths
    lengths = [min(new, max(8, int(rng.gauss(mean, spread)))) for _ in range(n)]
    completion = torch.full((n, new), tokenizer.pad_token_id)
    low, high = (3, len(tokenizer)) if tiny else (100, 20000)
    for i, k in enumerate(lengths):
        completion[i, :k] = torch.randint(low, high, (k,))
        completion[i, k - 1] = tokenizer.eos_token_id
    cmask = (torch.arange(new)[None] < torch.tensor(lengths)[:, None]).long()  # [N, T]
    batch = R.Rollout(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), completion, cmask,
                      [""] * n, [False] * n)
    logprobs = L.full_sequence_logprobs if path == "full" else L.sequence_logprobs
    times, profile, split = [], None, None
    for step in range(5 if path in MODES else 4):  # --compile: a 5th step under the profiler
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) \
            if step == 4 else None
        if profiler is not None:
            profiler.__enter__()
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad(), reference(policy):
            ref = logprobs(policy, batch).logp
        t1 = time.perf_counter()

        def loss(rows, logp, entropy, ref=ref):
            kl = (ref[rows] - logp).exp() - (ref[rows] - logp) - 1
            return ((logp - logp.detach()).exp() - 0.04 * kl).mul(cmask[rows]).sum() / n

        if path == "full":  # one forward of the batch, then one backward
            whole = L.full_sequence_logprobs(policy, batch, with_entropy=True)
            loss(torch.arange(n), whole.logp, whole.entropy).backward()
        else:  # as the trainer: each length bucket's backward right after its forward
            for bucket in L.buckets(policy, batch, with_entropy=True, grad=True, decoder=decoder):
                loss(bucket.rows, bucket.logp, bucket.entropy).backward()
        t2 = time.perf_counter()
        cpu = time.process_time() - c0
        policy.zero_grad()
        if profiler is not None:
            profiler.__exit__(None, None, None)
            profile = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
            split = classes([(e.key, e.input_shapes, e.self_cpu_time_total)
                             for e in profiler.key_averages(group_by_input_shape=True)],
                            model.config.vocab_size, RANK)
        else:
            times.append((t1 - t0, t2 - t1, cpu))
    ref_s, policy_s, cpu_s = (statistics.median(x) for x in zip(*times[1:]))
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"path": path, "ref_s": ref_s, "policy_fwd_bwd_s": policy_s, "update_s": ref_s + policy_s,
            "first_step_s": sum(times[0][:2]), "compile_s": decoder.compile_seconds if decoder is not None else 0.0,
            "update_cpu_s": cpu_s, "first_step_cpu_s": times[0][2], "graphs": decoder.graphs() if decoder else 0,
            "peak_rss_gb": rss_gb, "prompt_tokens": int(mask.sum()) * G, "completion_tokens": sum(lengths),
            "padded_width": ids.shape[1] + new, "profile": profile, "classes": split}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--new", type=int, help="most new tokens (default: 64, or 256 with --shape gsm8k)")
    ap.add_argument("--shape", choices=("arithmetic", "gsm8k"), default="arithmetic")
    ap.add_argument("--compile", action="store_true", help="eager vs compiled shared path, with a profile of each")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2")
    ap.add_argument("--one", choices=PATHS + MODES, help=argparse.SUPPRESS)  # a child process: one path, JSON out
    a = ap.parse_args()
    new = a.new or (256 if a.shape == "gsm8k" else 64)
    if a.one:
        print(json.dumps(measure(a.one, a.prompts, a.G, new, a.shape, a.tiny)))
        return
    paths = MODES if a.compile else PATHS
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(a.rounds):
        for path in paths:
            out = subprocess.run([sys.executable, __file__, "--one", path, "--prompts", str(a.prompts), "--G",
                                  str(a.G), "--new", str(new), "--shape", a.shape, *(["--tiny"] if a.tiny else [])],
                                 capture_output=True, text=True, check=True,
                                 env={"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
                                      **os.environ})
            runs[path].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {path}: {runs[path][-1]['update_s']:.2f} s", file=sys.stderr, flush=True)

    from rich.console import Console
    from rich.table import Table

    first = runs[paths[0]][0]
    table = Table(title=f"one update ({a.shape}), {a.prompts} prompts x G={a.G}, {first['completion_tokens']} "
                        f"completion + {first['prompt_tokens']} prompt tokens (padded {a.prompts * a.G} x "
                        f"{first['padded_width']}); median of {a.rounds} rounds")
    keys = ("ref_s", "policy_fwd_bwd_s", "update_s", "update_cpu_s", "peak_rss_gb") + (
        ("first_step_s", "first_step_cpu_s", "compile_s", "graphs") if a.compile else ())
    for col in ("path", *keys):
        table.add_column(col, justify="right")
    for path in paths:
        table.add_row(path, *(f"{statistics.median(r[k] for r in runs[path]):.2f}" for k in keys))
    ratio = statistics.median(r["update_s"] for r in runs[paths[1]]) / statistics.median(
        r["update_s"] for r in runs[paths[0]])
    Console().print(table)
    cpu_ratio = statistics.median(r["update_cpu_s"] for r in runs[paths[1]]) / statistics.median(
        r["update_cpu_s"] for r in runs[paths[0]])
    print(f"{paths[1]} / {paths[0]} update time: {ratio:.2f} (CPU seconds: {cpu_ratio:.2f})")
    if a.compile:  # the compile's CPU seconds: the compiled first step's excess over eager's first step
        extra = statistics.median(r["first_step_cpu_s"] - r["update_cpu_s"] for r in runs["compiled"]) - \
            statistics.median(r["first_step_cpu_s"] - r["update_cpu_s"] for r in runs["eager"])
        eager = statistics.median(r["update_cpu_s"] for r in runs["eager"])
        print(f"compile: {extra:.0f} CPU s = {extra / eager:.1f} eager updates")
    for path in paths if a.compile else ():
        print(f"\n{path}: top-10 operators of one step (last round), torch.profiler\n{runs[path][-1]['profile']}")
        split = runs[path][-1]["classes"]
        print(f"{path}: self seconds by class: " + ", ".join(
            f"{k} {v:.2f} s ({100 * v / split['total']:.0f}%)" for k, v in split.items() if k != "total")
            + f", total {split['total']:.2f} s")


if __name__ == "__main__":
    main()
