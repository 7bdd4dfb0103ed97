"""The calculator example, end to end: train with the calculator, train the same way without it, score both and the
base model on the held-out products (greedy), and write the table and the tool-call plot.

    python run.py              # the embedded SmolLM2-135M-Instruct, CPU (README: the claim, the endpoint)
    python run.py --demo       # the same with one demonstrated call in the system turn
    python run.py --smoke      # the tiny random model, 2 steps, 4 held-out problems: checks the plumbing only

Resumable: a run whose last checkpoint exists is not trained again, one cut short resumes from its last
checkpoint, and each score is kept in OUT/scores.json once made. Writes OUT/results.md and OUT/tool_calls.png
(OUT: runs/, runs_demo/ or runs_smoke/ beside this file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# one demonstrated call, for a model that cannot find the call format from the schemas alone (--demo)
DEMO = ('To multiply, call the calculator, for example: <tool_call>{"name": "calculator", "arguments": '
        '{"expression": "123 * 45"}}</tool_call> Then give its result as the final answer.')
TOOLS = ["env=tools", "env.tools=[calculator.calculator]", "env.max_turns=3", "env.max_episode_tokens=160"]
NO_TOOLS = ["sampler.max_new_tokens=96"]


def train_args(args) -> list[str]:
    """What both training runs share; they differ only in TOOLS or NO_TOOLS."""
    common = ["data=hf", "data.path=train.jsonl", "reward=custom", "reward.funcs=[answer_reward.correct]",
              "sampler=default", f"trainer.max_steps={args.steps}", f"trainer.save_every={max(1, args.steps // 3)}",
              "trainer.prompts_per_step=2", "algo.group_size=8", "trainer.report_to=[]"]
    if args.smoke:
        common += ["model=tiny", "algo.group_size=2"]
    return common + ([f"data.system_prompt='{DEMO}'"] if args.demo else [])


def train(run: Path, args, extra: list[str]) -> Path:
    """Train into `run` (or resume it, or leave a finished one alone); its last checkpoint."""
    last = run / "checkpoints" / f"step_{args.steps:06d}"
    if not last.exists():
        started = (run / "checkpoints").exists() and any((run / "checkpoints").glob("step_*"))
        argv = [f"resume={run}"] if started else [*train_args(args), *extra, f"hydra.run.dir={run}"]
        subprocess.run([sys.executable, "-m", "grpo_cli", "train", *argv], cwd=HERE, check=True)
    return last


def evaluate(args, checkpoint: Path | None, tools: bool) -> dict:
    """Greedy accuracy and tool calls per problem on the held-out products, with or without the calculator."""
    from grpo_cli import checkpoint as checkpoints
    from grpo_cli.config import compose
    from grpo_cli.env import from_config
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout import render_prompts
    from grpo_cli.rollout.episodes import EpisodeSampler

    sys.path.insert(0, str(HERE))  # calculator and answer_reward, as grpo train finds them
    from answer_reward import correct

    model = ["model=tiny"] if args.smoke else []
    cfg = compose("train", [*model, "sampler=default", *(TOOLS if tools else NO_TOOLS)])
    policy, tokenizer, _ = build_policy(cfg.model)
    if checkpoint is not None:
        checkpoints.load_adapter(policy, checkpoint)
    policy.eval()
    rows = [json.loads(line) for line in (HERE / "heldout.jsonl").read_text().splitlines()][:args.heldout]
    system = [{"role": "system", "content": DEMO}] if args.demo else []
    examples = [{"messages": [*system, {"role": "user", "content": r["prompt"]}], "question": r["prompt"],
                 "answer": r["answer"]} for r in rows]
    sampler = build(cfg.sampler)
    if tools:
        rollout = EpisodeSampler(sampler, from_config(cfg)).sample(policy, tokenizer, examples, 1, greedy=True)
        completions, calls = [e.messages for e in rollout.episodes], [e.tool_calls for e in rollout.episodes]
    else:
        rollout = sampler.generate(policy, tokenizer, render_prompts(tokenizer, [e["messages"] for e in examples]),
                                   1, greedy=True)
        completions, calls = rollout.texts, [0] * len(rows)
    scores = correct(completions, [r["answer"] for r in rows])
    return {"accuracy": sum(scores) / len(rows), "tool_calls": sum(calls) / len(rows), "problems": len(rows)}


def report(out: Path, scores: dict, tools_run: Path, seconds: float) -> None:
    """OUT/results.md (the table) and OUT/tool_calls.png (tool calls per episode over the training steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["| model | calculator at eval | held-out accuracy (greedy) | tool calls per problem |",
             "|---|---|---|---|"]
    for name, s in scores.items():
        model, at_eval = name.rsplit(" / ", 1)
        lines.append(f"| {model} | {at_eval} | {s['accuracy']:.3f} ({s['problems']} problems) "
                     f"| {s['tool_calls']:.2f} |")
    lines.append(f"\nwall time of this invocation: {seconds:.0f} s")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    records = [json.loads(line) for line in (tools_run / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r.get("tools/call_frequency", 0.0) for r in records], marker="o",
            label="tool calls per episode")
    ax.plot([r["step"] for r in records], [r["reward"] for r in records], marker=".", label="training reward")
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tool_calls.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, 2 steps: the plumbing only")
    parser.add_argument("--demo", action="store_true", help="one demonstrated call in the system turn")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each run (default 15; smoke 2)")
    parser.add_argument("--heldout", type=int, default=None, help="held-out problems scored (default 50; smoke 4)")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.smoke else 15)
    args.heldout = args.heldout or (4 if args.smoke else 50)
    start = time.time()
    out = HERE / ("runs_smoke" if args.smoke else "runs_demo" if args.demo else "runs")
    out.mkdir(exist_ok=True)
    with_tools = train(out / "with_tools", args, TOOLS)
    without_tools = train(out / "without_tools", args, NO_TOOLS)
    saved = out / "scores.json"
    scores = json.loads(saved.read_text()) if saved.exists() else {}
    plan = {"base / with": (None, True), "base / without": (None, False),
            "trained with tools / with": (with_tools, True), "trained without tools / without": (without_tools, False)}
    for name, (checkpoint, tools) in plan.items():
        if name not in scores:
            scores[name] = evaluate(args, checkpoint, tools)
            saved.write_text(json.dumps(scores, indent=1))
    report(out, scores, out / "with_tools", time.time() - start)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
