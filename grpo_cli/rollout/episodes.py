"""Multi-turn episodes as a sampler: `EpisodeSampler` wraps the run's sampler and answers `sample` with one episode
per completion (grpo_cli.env: tools or an environment class, token in and token out), as a `Rollout`.

The step calls `sample` on whichever sampler it holds and never asks whether episodes run. A row's prompt ids are
the rendered prompt (with the tools' schemas); its completion ids are the episode's ids in the engine's order, the
environment's ids masked out of the loss by `sampled_mask`; on vLLM its `sampling_logp` holds the engine's log-prob of
each sampled id (0 on the environment's, which the loss mask leaves out of `sampler/logp_gap` and the IS weights,
`algo.is_correction_cap`); its text is the episode decoded; it is truncated when the
token budget (`env.max_episode_tokens`) ended it. `Rollout.episodes` keeps each row's record (messages, tool calls
and failures, turns, the `env=class` instance) for the rewards, the metrics and completions.jsonl.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from grpo_cli.env import ToolFormat, choose, prepare, run_episodes
from grpo_cli.env.episode import encode
from grpo_cli.errors import DataError
from grpo_cli.metrics.console import console
from grpo_cli.policy import load_tokenizer, pad_id
from grpo_cli.rollout import Rollout, template_kwargs, use_chat_template
from grpo_cli.rollout.sizing import Job


def with_env(sampler, env, tool_format: ToolFormat | None = None):
    """The sampler a step calls: `sampler` itself without an environment (env=none), else its EpisodeSampler, with
    the tool format `early_format` chose (None: chosen at the first episode)."""
    return sampler if env is None else EpisodeSampler(sampler, env, tool_format)


@contextlib.contextmanager
def env_closed(sampler):
    """Leaving the block, also on an error: the environment of an EpisodeSampler closed (every instance's close()
    once, the tools' worker stopped), at the end of the run rather than whenever its objects are collected: a
    process that goes on (a sweep's next run, a test) sees them closed. Nothing to do for a plain sampler."""
    try:
        yield
    finally:
        if isinstance(sampler, EpisodeSampler):
            sampler.env.close()


def early_format(env, model_cfg, data) -> ToolFormat | None:
    """`env.tool_format` chosen before the model loads, on the model's tokenizer loaded without it and the data's
    chat template (and its variables): a format that does not fit the template is one line here, not after the
    model and the engine loaded. None without an environment, or when the tokenizer comes only with the model
    (a hub model not downloaded yet): then the first episode chooses, with the same checks."""
    if env is None:
        return None
    tokenizer = load_tokenizer(model_cfg)
    if tokenizer is None:
        return None
    use_chat_template(tokenizer, data.chat_template, data.chat_template_kwargs)
    return said(choose(env.tool_format, tokenizer, env.schemas, template_kwargs(tokenizer)))


def said(fmt: ToolFormat) -> ToolFormat:
    """`fmt`, its note printed when choosing it changed the template (a training template swapped in): one line."""
    if fmt.note:
        console.print(f"tools: {fmt.note}", markup=False, highlight=False, soft_wrap=True)
    return fmt


def episode_fields(rollout: Rollout) -> list[dict]:
    """What eval's and sample's files show of each row's episode: its turns (the assistant's text and calls, the
    tools' results), its tool calls and failures and why it ended; {} per row for plain completions."""
    if rollout.episodes is None:
        return [{} for _ in rollout.texts]
    return [{"turns": e.messages, "tool_calls": e.tool_calls, "tool_failures": e.tool_failures, "stop": e.stop}
            for e in rollout.episodes]


class EpisodeSampler:
    """The run's sampler with an `env` (a built `grpo_cli.env.ToolsEnv` or `ClassEnv`) between its turns."""

    def __init__(self, sampler, env, tool_format: ToolFormat | None = None):
        self.sampler, self.env = sampler, env
        self._format = tool_format  # the tool format: chosen before the model loaded, or once the tokenizer is known

    def __getattr__(self, name):  # the wrapped sampler's settings (max_new_tokens, ...) and its other calls
        if name in ("sampler", "env", "_format"):
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def sync(self, policy) -> None:
        self.sampler.sync(policy)

    def start(self, policy, section, job: Job | None = None):
        # every token after the prompt counts against env.max_episode_tokens: an engine that sizes itself (vLLM)
        # must hold the prompt and that many more
        job = replace(job or Job(1), max_new_tokens=self.env.limits.max_episode_tokens)
        return self.sampler.start(policy, section, job)

    def sample(self, policy, tokenizer, examples: list[dict], n: int, *, greedy: bool = False,
               generator: torch.Generator | None = None, temperature: float | None = None,
               max_new_tokens: int | None = None) -> Rollout:
        """`n` episodes per example (each with its own toolbox or environment instance), rows grouped by example;
        `temperature` in place of the sampler's (eval's samples). `max_new_tokens` is not read: an episode's
        length is env.max_episode_tokens, which config validation checks in its place."""
        if self._format is None:
            self._format = said(choose(self.env.tool_format, tokenizer, self.env.schemas, template_kwargs(tokenizer)))
        prompts, boxes = prepare(self.env, [e for e in examples for _ in range(n)])
        self._check_prompts(tokenizer, prompts, boxes)
        engine = self.sampler.engine(policy, tokenizer, greedy=greedy, generator=generator, temperature=temperature)
        try:
            episodes = run_episodes(engine, tokenizer, self._format, prompts, boxes, self.env.limits)
        finally:
            self.sampler.rest()
        return as_rollout(episodes, tokenizer)

    def _check_prompts(self, tokenizer, prompts: list[list[dict]], boxes: list) -> None:
        """DataError for a prompt over sampler.max_prompt_tokens once rendered with the tools' schemas."""
        limit = self.sampler.max_prompt_tokens
        for messages, box in zip(prompts, boxes, strict=True):
            pieces = self._format.prompt_pieces(tokenizer, messages, box.schemas)
            text, count = "".join(p for p, _ in pieces), len(encode(tokenizer, pieces))  # as the episode encodes it
            if count > limit:
                raise DataError(f"a prompt of {count} tokens with the tools' schemas is longer than "
                                f"sampler.max_prompt_tokens ({limit}): {text[:100]!r}...; raise "
                                f"sampler.max_prompt_tokens (and keep it + env.max_episode_tokens within the model's "
                                f"context) or shorten the prompts or the tools' docstrings")


def as_rollout(episodes: list, tokenizer) -> Rollout:
    """The Rollout of finished episodes: prompts left-padded, completions right-padded, environment ids marked."""
    pad = pad_id(tokenizer)
    n, width_p = len(episodes), max(len(e.prompt_ids) for e in episodes)
    width_t = max(1, max(len(e.completion_ids) for e in episodes))
    prompt_ids = torch.full((n, width_p), pad, dtype=torch.long)  # [N, P] left-padded
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((n, width_t), pad, dtype=torch.long)  # [N, T] right-padded
    completion_mask = torch.zeros_like(completion_ids)
    sampled = torch.zeros_like(completion_ids)  # [N, T] 1 on the ids the model sampled
    # [N, T] the engine's log-probs (vLLM), 0 on the environment's ids and on pad; None when it keeps none
    keeps = all(e.sampling_logp is not None for e in episodes)
    logp = torch.zeros((n, width_t), dtype=torch.float32) if keeps else None
    for i, e in enumerate(episodes):
        p, t = len(e.prompt_ids), len(e.completion_ids)
        prompt_ids[i, width_p - p:], prompt_mask[i, width_p - p:] = torch.tensor(e.prompt_ids), 1
        if t:
            completion_ids[i, :t], completion_mask[i, :t] = torch.tensor(e.completion_ids), 1
            sampled[i, :t] = torch.tensor(e.sampled)
            if logp is not None:
                logp[i, :t] = torch.tensor(e.sampling_logp, dtype=torch.float32)
    texts = tokenizer.batch_decode([e.completion_ids for e in episodes], skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts,
                   [e.stop == "budget" for e in episodes], sampling_logp=logp, sampled_mask=sampled,
                   episodes=list(episodes))
