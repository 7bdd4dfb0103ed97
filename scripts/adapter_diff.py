"""How far apart two runs' adapters are, checkpoint by checkpoint: for runs that should be the same (a killed and
resumed run against an uninterrupted one), so a difference is measured where there is one, not only detected.

    .venv/bin/python scripts/adapter_diff.py RUN_A RUN_B

Checkpoints are matched in the order the runs wrote them: the set-aside branches (checkpoints/abandoned-TIME/, oldest
first), then the kept ones. For each pair: whether every tensor is equal, the largest absolute difference, and that
over the largest absolute value in RUN_A's adapter.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpo_cli.checkpoint import ADAPTER, step_of


def _steps(folder: Path) -> list[Path]:
    """The step_N folders in `folder`, oldest first (a step_N.tmp being written is not one)."""
    return sorted((p for p in folder.glob("step_*") if step_of(p) is not None), key=step_of)


def checkpoints(run: Path) -> list[tuple[str, Path]]:
    """(label, folder) of every checkpoint of `run`, set-aside branches first (pass1, pass2, ...), then kept."""
    folder = run / "checkpoints"
    passes = sorted(folder.glob("abandoned-*"))  # named by the time they were set aside
    found = [(f"pass{i + 1}/{step.name}", step) for i, branch in enumerate(passes) for step in _steps(branch)]
    return found + [(f"kept/{step.name}", step) for step in _steps(folder)]


def difference(a: Path, b: Path) -> tuple[bool, float, float]:
    """(all tensors equal, max |a - b|, that / max |a|) of two checkpoints' adapters."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(a / ADAPTER), load_file(b / ADAPTER)
    if ta.keys() != tb.keys():
        sys.exit(f"{a} and {b} hold different tensors")
    largest = max((ta[k] - tb[k]).abs().max().item() for k in ta)
    scale = max(ta[k].abs().max().item() for k in ta)
    return all(torch.equal(ta[k], tb[k]) for k in ta), largest, largest / scale if scale else float("inf")


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    print("| checkpoint (A) | checkpoint (B) | equal | max abs difference | relative |\n|---|---|---|---|---|")
    for (label_a, path_a), (label_b, path_b) in zip(checkpoints(a), checkpoints(b)):
        equal, largest, relative = difference(path_a, path_b)
        print(f"| {label_a} | {label_b} | {equal} | {largest:.3g} | {relative:.3g} |")


if __name__ == "__main__":
    main()
