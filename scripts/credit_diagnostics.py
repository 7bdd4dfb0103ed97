"""Where step credit pushes a policy, read from a finished run's completions.jsonl (issue #44, item 1).

    .venv/bin/python scripts/credit_diagnostics.py RUN [RUN ...]      # e.g. outputs/process_vs_outcome/train/*

For each run folder (one trained with `trainer.log_completions_every=1`), per training step:
- the mean advantage on the EOS token (the decision to stop), recomputed from the logged rewards with the
  trainer's own functions: an outcome run's advantage is the same on every token; a process run's EOS gets the
  normalized steps that end with the completion (`objective.process_advantages`), plus the outcome half when the
  run's reward.process_weight is set;
- P(EOS | k-th claim line): of the completions that wrote at least k claim lines, the share that stopped right
  after the k-th (finished, no further claim line);
- what fills truncated tails: the lines of truncated completions after their last claim line that is new, as
  claim-free lines, repeated claim lines (the same claim again) and cut-off lines (the last, unfinished one).
Prints one table per run; `diagnose` returns the numbers for docs/process-supervision.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from grpo_cli.objective import outcome_advantages, process_advantages  # noqa: E402
from grpo_cli.rewards.steps import check_claims, split_steps  # noqa: E402

MAX_K = 4


def eos_advantages(group: list[dict], process_weight: float | None) -> list[float]:
    """The advantage each completion of one group (its G logged lines) gave its last token, its EOS."""
    if "steps" not in group[0]:
        return [float(line["advantage"]) for line in group]       # outcome: every token alike
    rewards, ends = [], []
    for line in group:
        eos = len(line["completion"])                              # a char-level completion: its EOS at len(text)
        steps = [(min(int(end) - 1, eos), r) for end, r in line["steps"]]
        if steps and all(end < eos for end, _ in steps):           # as the trainer: the last step ends on the EOS
            last = steps[-1][0]
            steps = [(eos if end == last else end, r) for end, r in steps]
        ends.append([end for end, _ in steps])
        rewards.append([r for _, r in steps])
    length = max(len(line["completion"]) for line in group) + 1
    process = process_advantages(rewards, ends, len(group), length)            # [G, length]
    eos = [process[i, len(line["completion"])].item() for i, line in enumerate(group)]
    if process_weight is None:
        return eos
    outcome = outcome_advantages(torch.tensor([float(line["rewards"].get("accuracy") or 0.0) for line in group]),
                                 len(group))
    return [o + process_weight * e for o, e in zip(outcome.tolist(), eos)]


def claim_lines(text: str) -> list[str]:
    """The completion's lines that make a checkable arithmetic claim (the chain judge's steps)."""
    return [text[a:b] for a, b in split_steps(text) if check_claims(text[a:b])]


def stop_after(lines: list[dict]) -> dict[int, float]:
    """k -> P(EOS | k-th claim line): among completions with >= k claim lines, the share that finished with k."""
    counts = [len(claim_lines(line["completion"])) for line in lines]
    out = {}
    for k in range(1, MAX_K + 1):
        reached = [(n, line) for n, line in zip(counts, lines) if n >= k]
        if reached:
            out[k] = sum(n == k and not line["truncated"] for n, line in reached) / len(reached)
    return out


def tail_kinds(lines: list[dict]) -> dict[str, int]:
    """The lines of truncated completions after their last new claim line, by kind."""
    kinds: dict[str, int] = defaultdict(int)
    for line in (x for x in lines if x["truncated"]):
        text = line["completion"]
        spans = split_steps(text)
        seen, last_new = set(), -1
        for i, (a, b) in enumerate(spans):
            if check_claims(text[a:b]) and " ".join(text[a:b].split()) not in seen:
                seen.add(" ".join(text[a:b].split()))
                last_new = i
        for i, (a, b) in enumerate(spans[last_new + 1:], start=last_new + 1):
            chunk = text[a:b]
            kind = ("cut off" if i == len(spans) - 1 else "repeated claim" if check_claims(chunk)
                    else "claim-free")
            kinds[kind] += 1
    return dict(kinds)


def diagnose(run: Path) -> dict:
    """Per training step: mean EOS advantage, P(EOS | k-th claim line), truncated share and tail kinds."""
    lines = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines() if x.strip()]
    weight = _process_weight(run)
    by_step: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        by_step[line["step"]].append(line)
    steps = {}
    for step, rows in sorted(by_step.items()):
        groups: dict[int, list[dict]] = defaultdict(list)
        for row in rows:
            groups[row["prompt_id"]].append(row)
        eos = [a for group in groups.values() for a in eos_advantages(group, weight)]
        steps[step] = {"eos_advantage": statistics.mean(eos), "stop_after": stop_after(rows),
                       "truncated": statistics.mean(r["truncated"] for r in rows), "tails": tail_kinds(rows)}
    return {"run": str(run), "process_weight": weight, "steps": steps}


def _process_weight(run: Path) -> float | None:
    """The run's reward.process_weight (None: outcome rewards, or step rewards alone)."""
    from omegaconf import OmegaConf

    found = [run / ".hydra" / "config.yaml", *sorted(run.glob("checkpoints/step_*/config.yaml"))]
    found = [path for path in found if path.exists()]
    if not found:
        return None
    weight = OmegaConf.load(found[0]).get("reward", {}).get("process_weight")
    return None if weight is None or weight == float("inf") else float(weight)


def render(found: dict) -> str:
    head = " | ".join(f"P(EOS|{k})" for k in range(1, MAX_K + 1))
    rows = [f"{found['run']} (process_weight {found['process_weight']})",
            f"| step | mean EOS advantage | {head} | truncated | truncated tails |",
            "|---|---|" + "---|" * MAX_K + "---|---|"]
    for step, s in found["steps"].items():
        stops = " | ".join(f"{s['stop_after'][k]:.2f}" if k in s["stop_after"] else "-" for k in range(1, MAX_K + 1))
        tails = ", ".join(f"{kind} {n}" for kind, n in sorted(s["tails"].items())) or "-"
        rows.append(f"| {step} | {s['eos_advantage']:+.3f} | {stops} | {s['truncated']:.2f} | {tails} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    for run in parser.parse_args().runs:
        print(render(diagnose(run)))


if __name__ == "__main__":
    main()
