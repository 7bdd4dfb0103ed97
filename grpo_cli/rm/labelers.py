"""Policy samples and the labelers (the `labeler` config group) that turn them into labeled rows:
problems picked from a task's train split -> completions drawn from the policy -> OutcomeLabeler,
VerifierLabeler or MonteCarloLabeler (Math-Shepherd, and where it departs: the package docstring).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from grpo_cli.errors import ConfigError
from grpo_cli.rewards.outcome import accuracy
from grpo_cli.rewards.steps import split_steps, verify_steps
from grpo_cli.rm.rows import Row
from grpo_cli.rollout import render_prompts


def pick_problems(dataset, count: int, seed: int) -> list[dict]:
    """`count` distinct problems of `dataset` (a task's train split), seeded; all of them if fewer."""
    indices = random.Random(seed).sample(range(len(dataset)), min(count, len(dataset)))
    return [dataset[i] for i in indices]


def draw_samples(policy, tokenizer, sampler, problems: list[dict], n: int, prompts_per_batch: int,
                 advance: Callable[[int], None] | None = None) -> list[dict]:
    """n completions per problem from `policy` (as it is: the caller picks adapter on/off).

    A sample is {"prompt": chat-templated prompt, "question", "answer", "completion", "truncated"}.
    """
    samples = []
    for first in range(0, len(problems), prompts_per_batch):
        batch = problems[first:first + prompts_per_batch]
        prompts = render_prompts(tokenizer, [p["messages"] for p in batch])
        out = sampler.generate(policy, tokenizer, prompts, n)
        for j, text in enumerate(out.texts):
            p = batch[j // n]
            samples.append({"prompt": prompts[j // n], "question": p["question"], "answer": p.get("answer"),
                            "completion": text, "truncated": out.truncated[j]})
        if advance:
            advance(len(batch))
    return samples


def _correct(completions: list[str], answer) -> list[float | None]:
    """1.0 / 0.0 per completion against one reference; None when there is no reference."""
    return accuracy([None] * len(completions), completions, [answer] * len(completions))


class OutcomeLabeler:
    """label = 1 when the final answer matches the reference, else 0 (rows without a reference dropped)."""

    kind = "outcome"

    def __call__(self, samples: list[dict], **_) -> list[Row]:
        rows = []
        for s in samples:
            label = _correct([s["completion"]], s["answer"])[0]
            if label is not None:
                rows.append({"prompt": s["question"], "completion": s["completion"], "label": label,
                             "answer": s["answer"]})
        return rows


class VerifierLabeler:
    """Step labels from the rule-based verifier: reward > 0 -> 1, < 0 -> 0, 0 -> no label."""

    kind = "process"

    def __init__(self, pattern: str | None):
        self.pattern = pattern

    def __call__(self, samples: list[dict], **_) -> list[Row]:
        rows = []
        for s in samples:
            # the answer's step (at the completion's end) labels the last line together with that line's own
            # reward, from their sum (a true last line with a wrong answer sums to 0: no label)
            text = s["completion"]
            last = len(text.rstrip())
            summed: dict[int, float] = {}
            for end, r in verify_steps(text, s["answer"], pattern=self.pattern):
                summed[min(end, last)] = summed.get(min(end, last), 0.0) + r
            steps = [[end, 1.0 if r > 0 else 0.0] for end, r in summed.items() if r != 0]
            if steps:
                rows.append({"prompt": s["question"], "completion": s["completion"], "steps": steps,
                             "answer": s["answer"]})
        return rows


class MonteCarloLabeler:
    """Math-Shepherd step labels: k continuations from the prefix ending each step.

    A step's label is 1 if any continuation reaches the reference answer (estimate=hard), or the
    fraction that do (estimate=soft). The last step of a completion that finished (EOS) is labeled
    by its own answer. Continuations use `sampler` on `policy` as it is called (adapter on or off
    is the caller's choice); prompt + prefix is generated from, and prefix + continuation is what
    the answer is read from.
    """

    kind = "process"

    def __init__(self, k: int, estimate: str, pattern: str | None, prompts_per_batch: int, max_new_tokens: int | None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"labeler.k ({k!r}) must be an integer >= 1 (continuations per step); set labeler.k=8")
        if estimate not in ("hard", "soft"):
            raise ConfigError(f"labeler.estimate ({estimate!r}) must be hard (any continuation right) or soft "
                              f"(the fraction right); set labeler.estimate=hard")
        if isinstance(prompts_per_batch, bool) or not isinstance(prompts_per_batch, int) or prompts_per_batch < 1:
            raise ConfigError(f"labeler.prompts_per_batch ({prompts_per_batch!r}) must be an integer >= 1; "
                              f"set labeler.prompts_per_batch=16")
        self.k, self.estimate, self.pattern = k, estimate, pattern
        self.prompts_per_batch, self.max_new_tokens = prompts_per_batch, max_new_tokens

    def jobs(self, samples: list[dict]) -> tuple[list[list[float | None]], list[tuple[int, int, str]]]:
        """(labels with None where continuations are needed, [(sample, step, prefix), ...] to continue)."""
        labels, jobs = [], []
        for i, s in enumerate(samples):
            spans = split_steps(s["completion"], self.pattern)
            mine: list[float | None] = []
            for j, (_, end) in enumerate(spans):
                if j == len(spans) - 1 and not s["truncated"]:
                    mine.append(_correct([s["completion"]], s["answer"])[0])
                else:
                    mine.append(None)
                    jobs.append((i, j, s["completion"][:end]))
            labels.append(mine)
        return labels, jobs

    def estimate_label(self, prefix: str, continuations: list[str], answer) -> float | None:
        hits = _correct([prefix + c for c in continuations], answer)
        if any(h is None for h in hits):
            return None
        right = sum(hits)
        return right / len(hits) if self.estimate == "soft" else float(right > 0)

    def __call__(self, samples: list[dict], *, policy=None, tokenizer=None, sampler=None,
                 advance: Callable[[int], None] | None = None, **_) -> list[Row]:
        labels, jobs = self.jobs(samples)
        if jobs and sampler is None:
            raise ConfigError("labeler=mc needs a policy to continue from each step; sample from a policy "
                              "(drop rm.labeled) or use labeler=verifier")
        for first in range(0, len(jobs), self.prompts_per_batch):
            chunk = jobs[first:first + self.prompts_per_batch]
            prompts = [samples[i]["prompt"] + prefix for i, _, prefix in chunk]
            out = sampler.generate(policy, tokenizer, prompts, self.k, max_new_tokens=self.max_new_tokens)
            for c, (i, j, prefix) in enumerate(chunk):
                continuations = out.texts[c * self.k:(c + 1) * self.k]
                labels[i][j] = self.estimate_label(prefix, continuations, samples[i]["answer"])
            if advance:
                advance(len(chunk))
        rows = []
        for s, mine in zip(samples, labels):
            spans = split_steps(s["completion"], self.pattern)
            steps = [[end, label] for (_, end), label in zip(spans, mine) if label is not None]
            if steps:
                rows.append({"prompt": s["question"], "completion": s["completion"], "steps": steps,
                             "answer": s["answer"]})
        return rows
