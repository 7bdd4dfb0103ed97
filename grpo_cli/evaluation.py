"""Scoring held-out problems: what `grpo eval` and `grpo train`'s in-run eval (trainer.eval_every) share.

    rows = score_batch(policy, tokenizer, sampler, reward_fn, problems)   # greedy: one row per problem
    result = summarize(name, step, rows)                                   # accuracy, mean reward, length, ...
    rows = greedy_rows(policy, tokenizer, sampler, reward_fn, problems, world, batch_size)   # every rank's share

A row holds a problem's greedy completion (temperature 0), its extracted answer, whether that matches the
reference `answer` (None for a prompt without one), its reward and length, and any sampled completions
(pass@k, maj@k). Accuracy counts the problems with a reference answer; the mean reward counts every completion,
so a dataset of open prompts is reported by its mean reward alone. The same rows and the same summary make the
in-run numbers `grpo eval`'s on the same checkpoint, problems and engine.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from omegaconf import DictConfig

from grpo_cli.distributed import World
from grpo_cli.errors import ConfigError
from grpo_cli.metrics.console import console
from grpo_cli.metrics.stats import mean, wilson_interval
from grpo_cli.policy import pad_id
from grpo_cli.rewards.call import score
from grpo_cli.rewards.outcome import answers_match, extract_answer, reference_answer
from grpo_cli.rollout import Rollout, render_prompts
from grpo_cli.rollout.episodes import episode_fields


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k), as a product so it never overflows."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(answers: list[str | None], reference: str) -> bool:
    """Is the most common extracted answer (ties: the first seen) correct? No answer never wins."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    return answers_match(votes.most_common(1)[0][0], reference)


def score_batch(policy, tokenizer, sampler, reward_fn, batch: list[dict], settings: DictConfig | None = None,
                generator: torch.Generator | None = None) -> list[dict]:
    """Greedy (and sampled) completions for a batch of problems, with answers, correctness and rewards. `settings`:
    `grpo eval`'s section (eval.max_new_tokens, num_samples, temperature); None: greedy only, as long as the
    sampler's max_new_tokens (an in-run eval)."""
    max_new_tokens, n = (settings.max_new_tokens, settings.num_samples) if settings is not None else (None, 0)
    prompts = render_prompts(tokenizer, [p["messages"] for p in batch])
    greedy = sampler.sample(policy, tokenizer, batch, 1, greedy=True, max_new_tokens=max_new_tokens,
                            generator=generator)
    sampled = (sampler.sample(policy, tokenizer, batch, n, max_new_tokens=max_new_tokens,
                              temperature=settings.temperature, generator=generator) if n else None)
    # every completion in one rollout, scored in one call: the greedy ones first, then n samples per problem, each
    # row the example it answers
    both = Rollout.cat([greedy, sampled] if sampled else [greedy], pad=pad_id(tokenizer))
    rewards = score(reward_fn, batch + [p for p in batch for _ in range(n)], both).rewards
    texts, lengths, truncated = both.texts, both.lengths, both.truncated
    # episodes (env=tools or class): each completion's turns for the file
    turns = episode_fields(both)
    rows = []
    for i, problem in enumerate(batch):
        ref = reference_answer(problem.get("answer"))  # None: a prompt without a reference answer
        picks = [i] + [len(batch) + i * n + j for j in range(n)]  # greedy, then this problem's samples
        completions = [{"text": texts[j], "answer": extract_answer(texts[j]), "reward": rewards[j],
                        "length": lengths[j], "truncated": truncated[j], **turns[j]} for j in picks]
        for c in completions:
            c["correct"] = None if ref is None else c["answer"] is not None and answers_match(c["answer"], ref)
        rows.append({"prompt": prompts[i], "question": problem["question"], "reference": ref,
                     "correct": completions[0]["correct"], "greedy": completions[0], "samples": completions[1:]})
    return rows


def summarize(name: str | None, step: int | None, rows: list[dict], settings: DictConfig | None = None) -> dict:
    """One checkpoint's numbers; accuracy, pass@k and maj@k (`grpo eval`'s eval.num_samples > 0, its eval.k) over
    the problems with a reference answer (None when none has one: a dataset of open prompts is scored by its mean
    reward alone)."""
    rows = sorted(rows, key=lambda r: r["index"])
    every = [r["greedy"] for r in rows] + [s for r in rows for s in r["samples"]]
    graded = [r for r in rows if r["reference"] is not None]
    out = {"checkpoint": name, "step": step, "num_problems": len(rows),
           "accuracy": mean(r["correct"] for r in graded) if graded else None,
           "mean_reward": mean(c["reward"] for c in every),
           "mean_length": mean(c["length"] for c in every),
           "truncation_rate": mean(c["truncated"] for c in every)}
    if settings is not None and settings.num_samples and graded:
        out["pass@k"] = {str(k): mean(pass_at_k(len(r["samples"]), sum(s["correct"] for s in r["samples"]), k)
                                      for r in graded) for k in settings.k}
        out["maj@k"] = {str(k): mean(majority_correct([s["answer"] for s in r["samples"][:k]], r["reference"])
                                     for r in graded) for k in settings.k}
    return out


# ---- the in-run eval of `grpo train` (trainer.eval_every, trainer.eval_size) ----------------------------------------

# trainer.eval_size=auto's most problems: grpo eval's default eval.limit, so the in-run best is ranked on the
# problems grpo eval ranks by default (the YAML line says so)
AUTO_EVAL_SIZE = 200


def eval_problems(data, every: int | None, size: int | str) -> list[dict]:
    """The first `size` problems of the data's held-out split that an in-run eval scores ([] with eval off). `auto`
    (the default): up to AUTO_EVAL_SIZE, the whole split when it is smaller, and no eval (one console line) without
    one, so the default never refuses a user's small dataset. An integer the user sets is held to it: a ConfigError,
    before the model loads, when the split is missing or smaller."""
    if every is None:
        return []
    heldout = list(getattr(data, "heldout", None) or [])
    if size == "auto":
        if not heldout:
            console.print(f"trainer.eval_every ({every}): the data ({type(data).__name__}) has no held-out split: no "
                          f"in-run eval (give it one with data.heldout_size)", markup=False, highlight=False)
        return heldout[:AUTO_EVAL_SIZE]
    if not heldout:
        raise ConfigError(f"trainer.eval_every ({every}) scores held-out problems and the data "
                          f"({type(data).__name__}) has none; set trainer.eval_every=null, or give the data a "
                          f"held-out split (data.heldout_size)")
    if size > len(heldout):
        count = f"{len(heldout)} problem{'s' if len(heldout) > 1 else ''}"
        raise ConfigError(f"trainer.eval_size ({size}) is larger than the data's held-out split ({count}); set "
                          f"trainer.eval_size={len(heldout)} (or auto), or hold out more (data.heldout_size)")
    return heldout[:size]


def greedy_rows(policy, tokenizer, sampler, reward_fn, problems: list[dict], world: World,
                batch_size: int) -> list[dict]:
    """Every problem's greedy row, on every rank: each rank scores every N-th problem in batches of `batch_size`
    (as `grpo eval` splits them), and the rows are gathered. `index` is the problem's place in `problems`."""
    mine = list(range(len(problems)))[world.rank::world.size]
    rows = []
    for start in range(0, len(mine), batch_size):
        picked = mine[start:start + batch_size]
        new = score_batch(policy, tokenizer, sampler, reward_fn, [problems[i] for i in picked])
        rows += [{**row, "index": i} for i, row in zip(picked, new)]
    return [row for part in world.gather(rows) for row in part]


def eval_metrics(rows: list[dict]) -> dict:
    """An in-run eval's record: eval/accuracy and its Wilson 95% interval (only where the problems have reference
    answers), eval/reward and eval/mean_length (tokens of the greedy completions)."""
    result = summarize(None, None, rows)
    out = {}
    if result["accuracy"] is not None:
        graded = [r["correct"] for r in rows if r["reference"] is not None]
        low, high = wilson_interval(sum(graded), len(graded))
        out.update({"eval/accuracy": result["accuracy"], "eval/accuracy_low": low, "eval/accuracy_high": high})
    out.update({"eval/reward": result["mean_reward"], "eval/mean_length": result["mean_length"]})
    return out


def eval_line(step: int, metrics: dict, problems: int) -> str:
    """The console's line for an in-run eval."""
    tail = f"reward {metrics['eval/reward']:.2f}, length {metrics['eval/mean_length']:.0f}"
    if "eval/accuracy" not in metrics:
        return f"step {step}: held-out {tail} ({problems} problems, no reference answers)"
    return (f"step {step}: held-out accuracy {metrics['eval/accuracy']:.3f} ({metrics['eval/accuracy_low']:.2f}-"
            f"{metrics['eval/accuracy_high']:.2f}, {problems} problems), {tail}")
