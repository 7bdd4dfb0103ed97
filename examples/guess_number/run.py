"""The guess-the-number example, end to end, in three resumable stages (README: the claim, the rule, the endpoint).

    python run.py probe     # the base model, no training: does it call the tool, and how often does it win? (the gate)
    python run.py train     # the arms, once the probe cleared: main, control 1 (uninformative), and their evals
    python run.py report    # OUT/results.md (the table, intervals, hinted-direction share) and OUT/curves.png
    python run.py probe --demos 2 --top 7   # a variant: more demonstrated games, a smaller range (README)
    python run.py probe --smoke             # the tiny random model: the plumbing only, no number means anything

Every command is a plain `grpo train` or `grpo eval` run from this folder (env=class with guess_game.py's classes,
data=env with the rows in data/, reward=custom with won_reward.won, sampler=auto: vLLM where it is installed).
Resumable: an eval folder whose eval.json exists is kept, a run whose last checkpoint exists is not trained again and
one cut short resumes from its last checkpoint. OUT is runs/ beside this file, runs_demos{N}_top{M}/ for a variant,
runs_smoke/ for --smoke.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from grpo_cli.metrics.stats import wilson_interval

HERE = Path(__file__).resolve().parent
# the gate, fixed before the probe ran: share of the base model's sampled episodes that call the tool at least once,
# and the range of its sampled success in which GRPO has groups to learn from and room above the no-feedback ceiling
PROBE_CALLS, PROBE_SUCCESS = 0.8, (0.1, 0.4)
# the primary endpoint: each held-out secret played this many times at temperature 1
SAMPLES, TEMPERATURE = 8, 1.0
# an episode: 4 guesses and a reply (the game counts 4 guesses, guess_game.MAX_GUESSES), within 256 tokens
EPISODE = ["env=class", "env.max_turns=5", "env.max_episode_tokens=256"]
# both training arms, the same but for the game's feedback: steps (--steps, 60) of 4 secrets x 8 episodes, a
# checkpoint every third of them
TRAIN = ["trainer.prompts_per_step=4", "algo.group_size=8", "trainer.eval_every=null", "trainer.report_to=[]"]
# the tiny random model's tokenizer is one token a character: the schema, the demonstration and the question make
# a prompt of ~1,300
SMOKE = ["model=tiny", "sampler.max_prompt_tokens=1600"]
# (arm, the run it evaluates or None for the base model, the game it plays at eval)
EVALS = [("base", None, "GuessNumber"), ("base", None, "Swapped"), ("main", "main", "GuessNumber"),
         ("main", "main", "Swapped"), ("uninformative", "uninformative", "GuessNumber")]
ARMS = {"main": "GuessNumber", "uninformative": "Uninformative"}


def data_path(args) -> Path:
    """data/ (secrets 1-15, one demonstrated game), or OUT/data for a variant: every row carries its range, its
    number of demonstrated games and their misses (guess_game.GuessNumber.reset reads them); train and held-out rows
    are the same
    secrets, since the prompt is the same for every secret and nothing in it can be memorized per secret."""
    if (args.top, args.demos, args.misses) == (15, 1, 0):
        return HERE / "data"
    folder = args.out / "data"
    if not (folder / "test.jsonl").exists():
        folder.mkdir(parents=True, exist_ok=True)
        variant = {"top": args.top, "demos": args.demos} | ({"misses": args.misses} if args.misses else {})
        rows = "".join(json.dumps({"secret": s, **variant}) + "\n" for s in range(1, args.top + 1))
        for split in ("train", "test"):
            (folder / f"{split}.jsonl").write_text(rows)
    return folder


def common(args, game: str) -> list[str]:
    """What every command here shares: the rows, the game, the episode's limits, the reward and the engine."""
    return ["data=env", f"data.path={data_path(args)}", f"env.factory=guess_game.{game}", *EPISODE,
            "reward=custom", "reward.funcs=[won_reward.won]", "sampler=auto", *(SMOKE if args.smoke else [])]


def grpo(*argv: str) -> None:
    subprocess.run([sys.executable, "-m", "grpo_cli", *argv], cwd=HERE, check=True)


def evaluate(args, arm: str, run: str | None, game: str) -> Path:
    """`grpo eval` of the base model (run None) or of a run's last checkpoint, on every held-out secret `SAMPLES`
    times at TEMPERATURE (and once greedy), playing `game`; kept in OUT/eval_{arm}_{game} once made."""
    folder = args.out / f"eval_{arm}_{game}"
    if not (folder / "eval.json").exists():
        model = [] if run is None else [f"checkpoint={last_checkpoint(args, run)}", "trust_run_config=true"]
        samples = 2 if args.smoke else SAMPLES
        grpo("eval", *model, *common(args, game), f"eval.limit={2 if args.smoke else args.top}",
             f"eval.num_samples={samples}", f"eval.temperature={TEMPERATURE}", f"eval.k=[1,{samples}]",
             f"hydra.run.dir={folder}")
    return folder


def last_checkpoint(args, run: str) -> Path:
    return args.out / run / "checkpoints" / f"step_{args.steps:06d}"


def train(args, run: str, game: str) -> None:
    """Train one arm into OUT/RUN (or resume it, or leave a finished one alone)."""
    folder = args.out / run
    if last_checkpoint(args, run).exists():
        return
    started = (folder / "checkpoints").exists() and any((folder / "checkpoints").glob("step_*"))
    steps = [f"trainer.max_steps={args.steps}", f"trainer.save_every={max(1, args.steps // 3)}"]
    argv = [f"resume={folder}"] if started else [*common(args, game), *TRAIN, *steps, f"hydra.run.dir={folder}"]
    grpo("train", *argv)


# ---- what the eval rows say --------------------------------------------------------------------------------------

def episodes(folder: Path) -> tuple[list[dict], list[dict]]:
    """(the sampled episodes, each with its row's secret index; the greedy ones) of an eval folder."""
    rows = [json.loads(line) for line in (folder / "eval_samples.jsonl").read_text().splitlines()]
    sampled = [{**s, "game": r["index"]} for r in rows for s in r["samples"]]
    return sampled, [r["greedy"] for r in rows]


# what the game answers a guess (guess_game): any other result is an error, a call that did not run as a guess
ANSWERS = ("higher", "lower", "correct", "wrong", "the game is over")


def guesses(turns: list[dict]) -> list[tuple[int, str]]:
    """(number guessed, the answer the model read) of each guess an episode made, in order: a call of guess whose
    result is the game's answer (not an error: a bad argument). A turn whose calls did not all parse (its results
    then outnumber its calls) is left out: its calls and results cannot be paired."""
    out = []
    for k, message in enumerate(turns):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        results = []
        for later in turns[k + 1:]:
            if later["role"] != "tool":
                break
            results.append(later["content"])
        calls = message["tool_calls"]
        if len(calls) != len(results):
            continue
        for c, answer in zip(calls, results):
            n = c["function"]["arguments"].get("n") if isinstance(c["function"]["arguments"], dict) else None
            if c["function"]["name"] == "guess" and isinstance(n, (int, float)) and answer in ANSWERS:
                out.append((int(n), answer))
    return out


def hinted_moves(episode_turns: list[list[dict]]) -> tuple[int, int]:
    """(next guesses that moved the way the hint said, guesses that followed a "higher" or "lower"), over episodes:
    after "higher" the next guess should be larger, after "lower" smaller, whatever the truth (under Swapped the
    hint is the swapped one the model read)."""
    moved = followed = 0
    for turns in episode_turns:
        made = guesses(turns)
        for (n, answer), (m, _) in zip(made, made[1:]):
            if answer in ("higher", "lower"):
                followed += 1
                moved += (m > n) if answer == "higher" else (m < n)
    return moved, followed


def cluster_bootstrap(wins: dict[int, list[bool]], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the success rate, the games (secrets) resampled with replacement: the 8 plays of
    one secret are not independent draws, which Wilson's interval assumes."""
    rng, games = random.Random(seed), list(wins)
    rates = []
    for _ in range(draws):
        picked = [w for g in (rng.choice(games) for _ in games) for w in wins[g]]
        rates.append(sum(picked) / len(picked))
    rates.sort()
    return rates[int(0.025 * draws)], rates[int(0.975 * draws) - 1]


def summary(folder: Path) -> dict:
    """The numbers of one eval folder: sampled success with Wilson's and the bootstrap's 95% intervals, the share of
    sampled episodes that call the tool, the hinted-direction share, greedy success, and the game it played."""
    sampled, greedy = episodes(folder)
    won = [bool(e["reward"]) for e in sampled]
    per_game: dict[int, list[bool]] = {}
    for e, w in zip(sampled, won):
        per_game.setdefault(e["game"], []).append(w)
    moved, followed = hinted_moves([e.get("turns", []) for e in sampled])
    config = json.loads((folder / "eval.json").read_text())["config"]
    # calls: episodes with a guess that ran (a call that parsed, named guess and gave a number); attempts: episodes
    # with any call, malformed ones included
    return {"game": config["env"]["factory"], "episodes": len(sampled), "wins": sum(won),
            "success": sum(won) / len(won), "wilson": wilson_interval(sum(won), len(won)),
            "bootstrap": cluster_bootstrap(per_game), "calls": sum(bool(guesses(e.get("turns", []))) for e in sampled),
            "attempts": sum(e.get("tool_calls", 0) > 0 for e in sampled),
            "guesses": sum(len(guesses(e.get("turns", []))) for e in sampled),
            "moved": moved, "followed": followed, "greedy_wins": sum(bool(g["reward"]) for g in greedy),
            "greedy": len(greedy)}


# ---- the stages --------------------------------------------------------------------------------------------------

def probe(args) -> dict:
    """The base model on every held-out secret: the gate's two numbers, written to OUT/probe.json and probe.md."""
    s = summary(evaluate(args, "base", None, "GuessNumber"))
    share = s["calls"] / s["episodes"]
    clears = share >= PROBE_CALLS and PROBE_SUCCESS[0] <= s["success"] <= PROBE_SUCCESS[1]
    result = {**s, "call_share": share, "clears": clears, "top": args.top, "demos": args.demos, "misses": args.misses}
    (args.out / "probe.json").write_text(json.dumps(result, indent=1))
    lines = [f"probe (base model, secrets 1-{args.top}, {args.demos} demonstrated game(s) with {args.misses} miss(es) "
             f"each, {s['episodes']} episodes at T={TEMPERATURE}):",
             f"  episodes that call the tool (a guess that ran): {s['calls']}/{s['episodes']} = {share:.3f} "
             f"(gate >= {PROBE_CALLS}); with any call, malformed ones included: {s['attempts']}/{s['episodes']}; "
             f"guesses that ran: {s['guesses']}",
             f"  success: {s['wins']}/{s['episodes']} = {s['success']:.3f}, Wilson 95% "
             f"[{s['wilson'][0]:.3f}, {s['wilson'][1]:.3f}], bootstrap over secrets "
             f"[{s['bootstrap'][0]:.3f}, {s['bootstrap'][1]:.3f}] (gate {PROBE_SUCCESS[0]}-{PROBE_SUCCESS[1]})",
             f"  greedy success: {s['greedy_wins']}/{s['greedy']}",
             f"  next guesses in the hinted direction: {s['moved']}/{s['followed']}",
             f"  clears the gate: {'yes' if clears else 'no'}"]
    (args.out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def train_arms(args) -> None:
    """Both arms, then every eval; only after a probe that cleared the gate (--smoke: the plumbing, no gate)."""
    gate = args.out / "probe.json"
    if not args.smoke and not (gate.exists() and json.loads(gate.read_text())["clears"]):
        sys.exit(f"the probe has not cleared its gate ({gate}); run `python run.py probe` first (README: the rule)")
    for run, game in ARMS.items():
        train(args, run, game)
    for arm, run, game in EVALS:
        evaluate(args, arm, run, game)


def report(args) -> None:
    """OUT/results.md: one line per (arm, game at eval); OUT/curves.png: training reward and tool calls per step."""
    ceiling = 4 / args.top
    lines = [f"secrets 1-{args.top}, {args.demos} demonstrated game(s); a policy that ignores the feedback wins at "
             f"most {ceiling:.3f}", "",
             "| arm | game at eval | success (T=1) | Wilson 95% | bootstrap 95% (secrets) | calls the tool "
             "| hinted direction | greedy |", "|---|---|---|---|---|---|---|---|"]
    for arm, _, game in EVALS:
        folder = args.out / f"eval_{arm}_{game}"
        if not (folder / "eval.json").exists():
            lines.append(f"| {arm} | {game} | not run | | | | | |")
            continue
        s = summary(folder)
        assert s["game"] == f"guess_game.{game}", f"{folder} played {s['game']}, not {game}"
        share = f"{s['moved']}/{s['followed']}" + (f" = {s['moved'] / s['followed']:.3f}" if s["followed"] else "")
        lines.append(f"| {arm} | {game} | {s['wins']}/{s['episodes']} = {s['success']:.3f} "
                     f"| [{s['wilson'][0]:.3f}, {s['wilson'][1]:.3f}] "
                     f"| [{s['bootstrap'][0]:.3f}, {s['bootstrap'][1]:.3f}] | {s['calls']}/{s['episodes']} "
                     f"| {share} | {s['greedy_wins']}/{s['greedy']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    curves(args)


def curves(args) -> None:
    """Training reward and tool calls per episode over the steps, one line per arm that has a metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {run: args.out / run / "metrics.jsonl" for run in ARMS if (args.out / run / "metrics.jsonl").exists()}
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for run, path in runs.items():
        records = [json.loads(line) for line in path.read_text().splitlines()]
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["reward"] for r in records], label=run)
        axes[1].plot(steps, [r.get("tools/call_frequency", 0.0) for r in records], label=run)
    axes[0].set_title("training reward (games won)")
    axes[1].set_title("tool calls per episode")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "curves.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["probe", "train", "report"])
    parser.add_argument("--demos", type=int, default=1, help="demonstrated games before the question (1 to 3)")
    parser.add_argument("--top", type=int, default=15, help="secrets 1..TOP (15: binary search wins in 4 guesses)")
    parser.add_argument("--misses", type=int, default=0,
                        help="wrong guesses (answered only 'wrong') before each demonstrated game's hit (0 to 2)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of each arm (default 60; smoke 2)")
    parser.add_argument("--smoke", action="store_true", help="the tiny random model: the plumbing only")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.smoke else 60)
    variant = f"runs_demos{args.demos}_top{args.top}" + (f"_misses{args.misses}" if args.misses else "")
    default = (args.top, args.demos, args.misses) == (15, 1, 0)
    args.out = HERE / ("runs_smoke" if args.smoke else "runs" if default else variant)
    args.out.mkdir(exist_ok=True)
    {"probe": probe, "train": train_arms, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
