"""The staleness probe, like with like: on the same prompts and the same samples of the step-40 policy, does a reward
model retrained on that policy's samples rank them better than one given the same number of extra samples from the
base policy?

    .venv/bin/python scripts/staleness_matched.py                            # SmolLM2-135M, the default job (hours)
    .venv/bin/python scripts/staleness_matched.py --smoke --out /tmp/match   # the tiny random model: the plumbing

Why (scripts/staleness_probe.py, 2026-12-05): its fall compared different prompt sets (prompts alone moved the AUC
by ~0.17) and its recovery compared a model with more training data against one without. Here both reward models
start from the same fixed model and get the same number of new rows, on the same training problems, with the same
replay draw; they differ only in which policy wrote the new rows. Both are measured on one set of samples.

The design, fixed before any run:
- the fixed reward model (rm_base): `grpo rm` on the base policy's samples of --problems (128) training problems x
  --samples (8) (rm.seed=0), as conf/rm says; its rows are replay iteration 0, copied into two replay folders, one
  for each model below, so that neither sees the other's rows.
- the policy: the default job, `grpo train` as conf/train.yaml says (40 steps, in-run eval, the guard), in OUT/train.
- the measured samples (set E): `grpo sample` of --samples (8) completions from the step-40 checkpoint on every one of
  the --prompts (500: the whole held-out split) held-out problems. No held-out problem is in a reward model's rows.
- policy-retrained (rm_policy): `grpo rm` from the step-40 checkpoint, continuing the fixed model (rm.init), on
  --problems training problems x --samples (rm.seed=1), with conf/rm's replay share of iteration 0.
- matched control (rm_matched): the same command from the base policy (no checkpoint): the same training problems
  (rm.seed=1 draws them), the same number of rows, the same replay draw; only the policy that wrote the rows differs.
- the measure: the within-prompt AUC (grpo_cli.rm.within_prompt_auc) on set E, per prompt with both a right and a
  wrong sample; the paired difference d = AUC(rm_policy) - AUC(rm_matched) over those prompts (the same samples
  under both models), its mean and 95% t-interval, and SE. Beside it: the fixed model on set E, and pooled AUCs.
- the threshold, verbatim: the iterative-vs-fixed experiment is worth running only if d's mean is >= 0.05 and its
  interval's lower end is > 0 ("retraining on the policy's own samples ranks them better than as much base data,
  by at least 0.05"). Otherwise the verdict is "undetermined at this scale", with the difference this design
  detects with 80% power, (t(0.975) + t(0.80)) x SE, and the experiment is not run. 0.05 is the smallest AUC gain
  the earlier probe's rule (0.10) halved: below it a retrained reward model's ranking of a group changes too little
  to matter for GRPO's advantages at G = 8.

Phases, each writing under OUT (a re-run skips a phase whose output is there): rm_base, train, samples/last.jsonl,
rm_policy, rm_matched, scores.json; then OUT/table.md and OUT/results.json. OUT defaults to
experiments/staleness_matched/, whose .gitignore keeps scores.json, the phases' wall times, table.md and
results.json in git; the phases' reward models are whole merged models (~0.5 GB each) and stay out, so the phases
before scores.json run in one session (about 2 h on a quiet 2-core machine, none beside it), and a session that ends
before scores.json starts them again on a new machine.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time

from paired import REPO, read_jsonl, t975, t_interval
from staleness_probe import arguments, fixed_model, measure, phase, prepare, rows_of, write_results

THRESHOLD = 0.05  # the mean paired AUC gain that makes the iterative-vs-fixed experiment worth running
T80 = 0.842  # the normal quantile at 0.80 (a large-sample power figure: the t's differ by < 0.01 past 100 df)


def verdict(policy: dict, matched: dict) -> tuple[str, dict]:
    """(the rule's line, the numbers): the paired difference over set E's prompts with both labels."""
    a, b = policy.get("per_prompt", {}), matched.get("per_prompt", {})
    diffs = [a[p] - b[p] for p in a if p in b]
    if len(diffs) < 2:
        return ("undetermined: fewer than 2 prompts of set E have both a right and a wrong sample, so the paired "
                "within-prompt AUC is not measured", {"prompts": len(diffs)})
    mean, lower, upper = t_interval(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    detectable = (t975(len(diffs) - 1) + T80) * se
    numbers = {"prompts": len(diffs), "mean": mean, "lower": lower, "upper": upper, "se": se,
               "detectable": detectable}
    if mean >= THRESHOLD - 1e-9 and lower > 0:
        return (f"staleness shows: retraining on the step-40 policy's samples ranks them better than as much base "
                f"data by {mean:+.3f} (95% {lower:+.3f} … {upper:+.3f}, {len(diffs)} prompts), past the threshold "
                f"({THRESHOLD}): the iterative-vs-fixed experiment is worth running", numbers)
    return (f"undetermined at this scale: retrained on the policy's samples minus matched base data {mean:+.3f} "
            f"(95% {lower:+.3f} … {upper:+.3f}, {len(diffs)} prompts) does not clear the threshold (mean >= "
            f"{THRESHOLD}, lower end > 0); this design detects {detectable:.3f} with 80% power; the "
            f"iterative-vs-fixed experiment is not run", numbers)


def table(scores: dict, line: str, step: int = 40) -> str:
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    out = ["| reward model | new rows from | within-prompt AUC on set E (prompts with both labels) | pooled AUC |",
           "|---|---|---|---|"]
    for key, name, source in (("fixed", "fixed (rm_base)", "– (base samples only)"),
                              ("matched", "matched control (rm_matched)", "the base policy"),
                              ("policy", "policy-retrained (rm_policy)", f"the step-{step} policy")):
        m = scores[key]
        out.append(f"| {name} | {source} | {fmt(m['auc'])} ({m['prompts']}) | {fmt(m['pooled_auc'])} |")
    m = scores["policy"]
    out += ["", f"set E: {m['of_prompts']} held-out prompts, {m['rows']} samples of the step-{step} policy, "
                f"{m['right']} right.", f"**{line}**"]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = arguments(__doc__, 500, "held-out problems in set E", "staleness_matched")
    parser.add_argument("--steps", type=int, default=40, help="the policy checkpoint's step")
    parser.set_defaults(out=REPO / "experiments" / "staleness_matched")
    args = parser.parse_args()
    started = time.perf_counter()
    out, model, train, rm_more, sizes = prepare(args, smoke_steps=2)

    fixed = fixed_model(out, sizes, model, rm_more)
    for arm in ("policy", "matched"):  # iteration 0 for each, apart: neither model replays the other's rows
        if not (out / f"replay_{arm}").exists():
            shutil.copytree(out / "replay", out / f"replay_{arm}")
    last = out / "train" / "checkpoints" / f"step_{args.steps:06d}"
    phase("train", last, out, "train", "trainer.report_to=[]", f"hydra.run.dir={out / 'train'}", *model, *train)
    target = out / "samples" / "last.jsonl"
    phase("samples_last", target, out, "sample", f"checkpoint={last}", f"sample.num_prompts={args.prompts}",
          f"sample.n={args.samples}", f"sample.output={target}", *args.overrides)
    for arm, source in (("policy", [f"checkpoint={last}"]), ("matched", [])):
        phase(f"rm_{arm}", out / f"rm_{arm}" / "model", out, "rm", *source, f"rm.init={fixed}", *sizes, "rm.seed=1",
              f"rm.replay.folder={out / f'replay_{arm}'}", f"hydra.run.dir={out / f'rm_{arm}'}",
              *(args.overrides if source else model), *rm_more)

    scores_file = out / "scores.json"
    if not scores_file.exists():
        rows = rows_of(read_jsonl(target))
        scores = {"fixed": measure(fixed, rows), "matched": measure(out / "rm_matched" / "model", rows),
                  "policy": measure(out / "rm_policy" / "model", rows)}
        scores_file.write_text(json.dumps(scores, indent=1))
    scores = json.loads(scores_file.read_text())
    line, numbers = verdict(scores["policy"], scores["matched"])
    write_results(out, {"scores": scores, "verdict": line, **numbers}, table(scores, line, args.steps), args,
                  started)


if __name__ == "__main__":
    main()
