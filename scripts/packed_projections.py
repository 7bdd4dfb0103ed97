"""Time a decoder layer's input projections one by one against packed, forward + backward (a lever tried for #43).

    .venv/bin/python scripts/packed_projections.py                 # 1,024 and 384 rows, 5 rounds of 15 each
    .venv/bin/python scripts/packed_projections.py --rows 1024 --rounds 3

The five projections that read the same input in a Llama layer (q, k, v after the input norm; gate, up after the
post-attention norm), each with its LoRA (r=16), at SmolLM2-135M's sizes: one by one, as `lora.LeanLinear` runs
them (`base(x).addmm_(s·A x, Bᵀ)` per projection: 15 matrix multiplies forward), or packed as a fused QKV and
gate-up would run them (the frozen weights stacked, [960, 576] and [3072, 576]; the adapters' A stacked, their B
block-diagonal: 6 forward). Same numbers up to float rounding (`tests/unit/scripts/test_packed_projections.py`).
The backward is the update's: the base weights frozen, the gradient to the input and to A and B. Rounds alternate
the two ways on the same tensors; each prints its median and the ratio. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, KV, MLP, RANK, SCALING = 576, 192, 1536, 16, 2.0  # SmolLM2-135M; LoRA r=16, alpha=32
GROUPS = (("q", "k", "v"), ("gate", "up"))  # projections that read the same input
WIDTH = {"q": HIDDEN, "k": KV, "v": KV, "gate": MLP, "up": MLP}


def weights(seed: int = 0) -> dict:
    """Frozen base weights [out, in] and trainable LoRA A [r, in], B [out, r] per projection, and the packed bases."""
    g = torch.Generator().manual_seed(seed)
    w = {n: torch.randn(o, HIDDEN, generator=g) * 0.02 for n, o in WIDTH.items()}
    a = {n: (torch.randn(RANK, HIDDEN, generator=g) * 0.02).requires_grad_() for n in WIDTH}
    b = {n: (torch.randn(o, RANK, generator=g) * 0.02).requires_grad_() for n, o in WIDTH.items()}
    packed = {names: torch.cat([w[n] for n in names]) for names in GROUPS}  # stacked once, as a packed model would
    return {"w": w, "a": a, "b": b, "packed": packed}


def one_by_one(x: torch.Tensor, p: dict) -> list[torch.Tensor]:
    """[M, 576] -> each projection's [M, out], as LeanLinear: base, then += (s·A x) Bᵀ."""
    out = []
    for n in WIDTH:
        y = x @ p["w"][n].T
        out.append(y.addmm_((x @ p["a"][n].T) * SCALING, p["b"][n].T))
    return out


def packed(x: torch.Tensor, p: dict) -> list[torch.Tensor]:
    """[M, 576] -> the same outputs from one base matmul and one low-rank pair per group, split after."""
    out = []
    for names in GROUPS:
        y = x @ p["packed"][names].T  # [M, sum of outs]
        low = (x @ torch.cat([p["a"][n] for n in names]).T) * SCALING  # [M, r * len(names)]
        y.addmm_(low, torch.block_diag(*[p["b"][n] for n in names]).T)  # each B reads only its own r columns
        out.extend(y.split([WIDTH[n] for n in names], 1))
    return out


def step_seconds(fn, x: torch.Tensor, p: dict, grads: list[torch.Tensor], reps: int) -> float:
    """Median seconds of forward + backward (into x and the adapters) over `reps`."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.autograd.backward(fn(x, p), grads)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 384],
                    help="rows a call (a GSM8K-shape bucket: 4 x 256; an arithmetic one: 8 x ~48)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    p = weights()
    for rows in a.rows:
        x = torch.randn(rows, HIDDEN, requires_grad=True)
        grads = [torch.randn(rows, WIDTH[n]) for n in WIDTH]
        flop = 2 * 2 * rows * HIDDEN * sum(WIDTH.values())  # forward + the input's gradient, base weights only
        ratios = []
        for r in range(a.rounds):
            apart, together = step_seconds(one_by_one, x, p, grads, a.reps), step_seconds(packed, x, p, grads, a.reps)
            ratios.append(together / apart)
            print(f"rows {rows} round {r + 1}: one by one {apart * 1e3:.1f} ms ({flop / apart / 1e9:.0f} GFLOP/s), "
                  f"packed {together * 1e3:.1f} ms, ratio {ratios[-1]:.3f}")
        print(f"rows {rows}: median ratio packed / one by one {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
