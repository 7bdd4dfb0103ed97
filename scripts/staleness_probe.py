"""The staleness probe before iterative RL (issue #44, item 5): does a reward model trained on the base policy's
samples rank a GRPO-trained policy's samples worse, and does retraining on them win the ranking back?

    .venv/bin/python scripts/staleness_probe.py                            # SmolLM2-135M, the default job
    .venv/bin/python scripts/staleness_probe.py --smoke --out /tmp/probe   # the tiny random model, tiny sizes

The design, fixed before any run:
- the measure: the within-prompt AUC (`grpo_cli.rm.within_prompt_auc`): for each prompt whose samples hold both a
  right and a wrong answer (the rule's label: `grpo sample`'s `correct`), the AUC of the reward model's scores among
  that prompt's samples, ties 1/2; the mean over those prompts. GRPO only uses the ranking within a group, so this
  is the ranking that reaches the policy. The pooled AUC and the number of prompts the mean rests on stand beside it.
- the fixed reward model: `grpo rm` on the base policy's samples of --problems (128) training problems x --samples
  (8), the rest as conf/rm says (OUT/rm_base); its rows go into the replay folder OUT/replay as iteration 0.
- the policy: the default job, `grpo train` as conf/train.yaml says (40 steps, a checkpoint every 10), in
  OUT/train; its checkpoints at --steps (20, 40).
- the measured samples: `grpo sample` of --samples (8) completions on each of the first --prompts (64) held-out
  problems (set A) from the base policy and from the step-20 and step-40 checkpoints; the step-40 checkpoint also on
  the next --prompts held-out problems (set C). No held-out problem is in any reward model's rows (`grpo rm` draws
  from the train split).
- the retrained reward model: `grpo rm` from the step-40 checkpoint, continuing the fixed model (rm.init), on
  --problems training problems x --samples of the step-40 policy (rm.seed=1), with conf/rm's replay share of the base
  rows (OUT/rm_last). It is measured on set C, prompts it never saw, beside the fixed model on the same samples.
- fall = AUC(fixed, base, A) - AUC(fixed, step 40, A); recovery = AUC(retrained, step 40, C) - AUC(fixed, step 40,
  C). The step-20 row is descriptive (where a fall would begin); the rule reads base, step 40 and set C.
- beside the rule (it reads the point values; added after the first run, which showed how few prompts each AUC
  rests on): 95% t-intervals over prompts. The recovery is paired (the same samples of set C, each prompt's AUC
  under both models); the fall compares two sets of samples of the same prompts, whose prompts with both labels
  differ, so it is unpaired (the two standard errors combined, t at the smaller count's degrees of freedom).
- the decision rule, verbatim: if the fixed model's AUC does not fall by >= 0.10 while retraining recovers >= 0.10,
  report "staleness does not occur at this scale" and stop. Read: staleness shows only when fall >= 0.10 and
  recovery >= 0.10; otherwise the script reports "staleness does not occur at this scale" (and so iterative RL's
  benefit is untestable here) and the iterative-vs-fixed experiment is not run. An AUC that cannot be measured (no
  prompt with both labels) makes the verdict "undetermined", naming the measurement.

Phases, each writing its output under OUT (a re-run skips a phase whose output is there): rm_base, train,
samples/{base,mid,last}.jsonl (steps 20 and 40), rm_last, scores.json; then OUT/table.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from paired import REPO, grpo, read_jsonl, t975, t_interval

sys.path.insert(0, str(REPO))  # this checkout's grpo_cli, as the grpo subprocesses run it

from grpo_cli.cli import setup_process  # noqa: E402

FALL = RECOVERY = 0.10  # the decision rule's bars

# --smoke: the tiny random model (never right, so every AUC is unmeasurable) and sizes that run in a minute or two
SMOKE_MODEL = ["model=tiny", "sampler.max_new_tokens=8"]
SMOKE_TRAIN = ["algo.group_size=4", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
               "trainer.warmup_steps=0", "trainer.max_steps=2", "trainer.save_every=1"]
SMOKE_RM = ["rm.epochs=1", "rm.batch_size=4", "rm.lora.r=4", "rm.lora.alpha=8"]


def phase(name: str, done: Path, out: Path, *args: str) -> float | None:
    """Run `grpo ARGS` unless `done` exists; its wall time (OUT/wall_s.json keeps it for the table)."""
    walls_file = out / "wall_s.json"
    walls = json.loads(walls_file.read_text()) if walls_file.exists() else {}
    if not done.exists():
        print(f"{name}: grpo {' '.join(args)}", flush=True)
        walls[name] = grpo(*args, log=out / "logs" / f"{name}.log")
        walls_file.write_text(json.dumps(walls, indent=1))
    return walls.get(name)


def rows_of(samples: list[dict]) -> list[dict]:
    """`grpo sample`'s records as outcome rows: the question, the completion, the rule's label (no answer found is
    wrong, as `OutcomeLabeler` labels it; a problem without a reference answer gives no row)."""
    return [{"prompt": s["question"], "completion": s["completion"], "label": float(bool(s["correct"]))}
            for s in samples if s["reference"] is not None]


def measure(folder: Path, rows: list[dict]) -> dict:
    """The reward model in `folder` on `rows`: within-prompt and pooled AUC, the prompts and right answers counted,
    and each prompt's own AUC (the prompts with both labels) for the intervals."""
    # imported here, after main's setup_process: the libraries read its quiet settings when they load
    import torch

    from grpo_cli import rm
    from grpo_cli.policy import resolve_device

    device = resolve_device("auto")
    model, tokenizer = rm.load_classifier(folder, "outcome", device, torch.float32)
    template = json.loads((folder / "rm.json").read_text())["template"]
    scores, labels = rm.predict(model, tokenizer, rows, kind="outcome", template=template)
    prompts = [r["prompt"] for r in rows]
    m = rm.classification_metrics(scores, labels, prompts)
    per_prompt = rm.within_prompt_auc(scores, [y >= 0.5 for y in labels], prompts).per_prompt
    return {"auc": m["auc_within_prompt"], "prompts": m["auc_prompts"], "pooled_auc": m["auc"],
            "rows": m["labels"], "right": m["positives"], "of_prompts": len(set(prompts)), "per_prompt": per_prompt}


def intervals(scores: dict) -> dict:
    """95% t-intervals (mean, lower, upper) of the fall (unpaired: base and step-40 samples of set A) and the
    recovery (paired over set C's prompts); None where a side has fewer than 2 prompts with both labels."""
    base, last = (list(scores[k].get("per_prompt", {}).values()) for k in ("fixed_base_A", "fixed_last_A"))
    fixed, retrained = scores["fixed_last_C"].get("per_prompt", {}), scores["retrained_C"].get("per_prompt", {})
    fall = None
    if len(base) > 1 and len(last) > 1:
        mean = statistics.mean(base) - statistics.mean(last)
        se = math.sqrt(statistics.variance(base) / len(base) + statistics.variance(last) / len(last))
        half = t975(min(len(base), len(last)) - 1) * se
        fall = (mean, mean - half, mean + half)
    paired = [retrained[p] - fixed[p] for p in fixed if p in retrained]
    return {"fall": fall, "recovery": t_interval(paired) if len(paired) > 1 else None}


def verdict(scores: dict, last: int = 40) -> tuple[str, dict]:
    """(the decision rule's line, the fall and recovery) from `scores`' four AUCs the rule reads; `last`: the step of
    the last checkpoint."""
    need = {"fixed on base, set A": scores["fixed_base_A"], f"fixed on step {last}, set A": scores["fixed_last_A"],
            f"fixed on step {last}, set C": scores["fixed_last_C"],
            f"retrained on step {last}, set C": scores["retrained_C"]}
    missing = [name for name, m in need.items() if m["auc"] is None]
    if missing:
        return (f"undetermined: no prompt with both a right and a wrong sample in {', '.join(missing)}, so the "
                f"within-prompt AUC the rule reads is not measured", {"fall": None, "recovery": None})
    fall = scores["fixed_base_A"]["auc"] - scores["fixed_last_A"]["auc"]
    recovery = scores["retrained_C"]["auc"] - scores["fixed_last_C"]["auc"]
    numbers = {"fall": fall, "recovery": recovery}
    if fall >= FALL - 1e-9 and recovery >= RECOVERY - 1e-9:  # 0.7 - 0.6 is 0.0999...: the bar is inclusive
        return (f"staleness occurs: the fixed model's within-prompt AUC falls by {fall:.3f} (>= {FALL}) and "
                f"retraining recovers {recovery:.3f} (>= {RECOVERY}); the iterative-vs-fixed experiment is worth "
                f"running", numbers)
    return (f"staleness does not occur at this scale: the fixed model's within-prompt AUC falls by {fall:+.3f} and "
            f"retraining recovers {recovery:+.3f} (the rule needs >= {FALL} both); iterative RL's benefit is "
            f"untestable here, so the experiment is not run", numbers)


def table(scores: dict, line: str, numbers: dict, mid: int = 20, last: int = 40) -> str:
    """The AUC table (markdown), the fall and recovery, and the verdict; `mid`, `last`: the checkpoints' steps."""
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    out = ["| samples | prompts | right / rows | reward model | within-prompt AUC (prompts with both labels) | "
           "pooled AUC |", "|---|---|---|---|---|---|"]
    for key, samples, prompts, model in (("fixed_base_A", "base", "A", "fixed"),
                                         ("fixed_mid_A", f"step {mid}", "A", "fixed"),
                                         ("fixed_last_A", f"step {last}", "A", "fixed"),
                                         ("fixed_last_C", f"step {last}", "C", "fixed"),
                                         ("retrained_C", f"step {last}", "C", f"retrained on step {last}")):
        m = scores[key]
        out.append(f"| {samples} | {prompts} ({m['of_prompts']}) | {m['right']} / {m['rows']} | {model} | "
                   f"{fmt(m['auc'])} ({m['prompts']}) | {fmt(m['pooled_auc'])} |")
    out.append("")
    out.append(f"fall (fixed, base → step {last}, set A): {fmt(numbers['fall'])}; recovery (retrained − fixed, "
               f"step {last}, set C): {fmt(numbers['recovery'])}.")
    spans = intervals(scores)
    for name, span in spans.items():
        if span is not None:
            out.append(f"{name}: 95% t-interval over prompts {span[1]:+.3f} … {span[2]:+.3f} (beside the rule, which "
                       f"reads the point values).")
    out.append(f"**{line}**")
    return "\n".join(out) + "\n"


def arguments(doc: str, prompts: int, prompts_help: str, out_name: str) -> argparse.ArgumentParser:
    """The options this probe and scripts/staleness_matched.py share (each adds its own --steps)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--problems", type=int, default=128, help="training problems of each grpo rm")
    parser.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    parser.add_argument("--samples", type=int, default=8, help="completions per problem, everywhere")
    parser.add_argument("--smoke", action="store_true", help="the tiny random model, tiny sizes: the plumbing")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / out_name)
    parser.add_argument("overrides", nargs="*", help="more overrides for every grpo command (key=value)")
    return parser


def prepare(args, smoke_steps) -> tuple[Path, list[str], list[str], list[str], list[str]]:
    """The process set up as a grpo command's (the libraries' loading bars and notices off the console), --smoke's
    tiny model and sizes, OUT's folders: (OUT, the model's overrides, train's, grpo rm's, grpo rm's sizes)."""
    setup_process()
    model, train, rm_more = list(args.overrides), [], []
    if args.smoke:
        args.problems, args.prompts, args.samples, args.steps = 4, 4, 2, smoke_steps
        model, train, rm_more = SMOKE_MODEL + model, SMOKE_TRAIN, SMOKE_RM
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "samples").mkdir(exist_ok=True)
    sizes = [f"rm.num_problems={args.problems}", f"rm.samples_per_problem={args.samples}"]
    return out, model, train, rm_more, sizes


def fixed_model(out: Path, sizes: list[str], model: list[str], rm_more: list[str]) -> Path:
    """The fixed reward model: `grpo rm` on the base policy's samples (OUT/rm_base), its rows replay iteration 0
    (OUT/replay); its folder."""
    phase("rm_base", out / "rm_base" / "model", out, "rm", *sizes, f"rm.replay.folder={out / 'replay'}",
          f"hydra.run.dir={out / 'rm_base'}", *model, *rm_more)
    return out / "rm_base" / "model"


def write_results(out: Path, results: dict, text: str, args, started: float) -> None:
    """OUT/results.json (`results`, the phases' wall times, the arguments) and OUT/table.md (`text`), printed."""
    walls = json.loads((out / "wall_s.json").read_text()) if (out / "wall_s.json").exists() else {}
    (out / "results.json").write_text(json.dumps({**results, "wall_s": walls,
                                                  "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    (out / "table.md").write_text(text)
    print(text)
    print(f"this invocation {time.perf_counter() - started:.0f} s; phases {walls}; {out / 'results.json'}")


def main() -> None:
    parser = arguments(__doc__, 64, "held-out problems in each measured set (A, C)", "staleness_probe")
    parser.add_argument("--steps", default="20,40", help="the two checkpoint steps measured (mid, last)")
    args = parser.parse_args()
    started = time.perf_counter()
    out, model, train, rm_more, sizes = prepare(args, smoke_steps="1,2")
    mid, last = (int(s) for s in args.steps.split(","))

    fixed = fixed_model(out, sizes, model, rm_more)
    ckpt = {s: out / "train" / "checkpoints" / f"step_{s:06d}" for s in (mid, last)}
    phase("train", ckpt[last], out, "train", "trainer.report_to=[]", f"hydra.run.dir={out / 'train'}", *model, *train)
    for name, source, prompts in (("base", [], args.prompts), ("mid", [f"checkpoint={ckpt[mid]}"], args.prompts),
                                  ("last", [f"checkpoint={ckpt[last]}"], 2 * args.prompts)):
        target = out / "samples" / f"{name}.jsonl"
        phase(f"samples_{name}", target, out, "sample", *source, f"sample.num_prompts={prompts}",
              f"sample.n={args.samples}", f"sample.output={target}",
              *(model if name == "base" else args.overrides))
    phase("rm_last", out / "rm_last" / "model", out, "rm", f"checkpoint={ckpt[last]}",
          f"rm.init={fixed}", *sizes, "rm.seed=1", f"rm.replay.folder={out / 'replay'}",
          f"hydra.run.dir={out / 'rm_last'}", *args.overrides, *rm_more)

    scores_file = out / "scores.json"
    if not scores_file.exists():
        samples = {name: read_jsonl(out / "samples" / f"{name}.jsonl") for name in ("base", "mid", "last")}
        rows = {name: rows_of(records) for name, records in samples.items()}
        # grpo sample answers held-out problems in order: the first --prompts are set A, the next set C
        set_c = set(list(dict.fromkeys(s["question"] for s in samples["last"]))[args.prompts:])
        last_a = [r for r in rows["last"] if r["prompt"] not in set_c]
        last_c = [r for r in rows["last"] if r["prompt"] in set_c]
        retrained = out / "rm_last" / "model"
        scores = {"fixed_base_A": measure(fixed, rows["base"]), "fixed_mid_A": measure(fixed, rows["mid"]),
                  "fixed_last_A": measure(fixed, last_a), "fixed_last_C": measure(fixed, last_c),
                  "retrained_C": measure(retrained, last_c)}
        scores_file.write_text(json.dumps(scores, indent=1))
    scores = json.loads(scores_file.read_text())
    line, numbers = verdict(scores, last)
    write_results(out, {"scores": scores, "verdict": line, **numbers, "intervals": intervals(scores)},
                  table(scores, line, numbers, mid, last), args, started)


if __name__ == "__main__":
    main()
