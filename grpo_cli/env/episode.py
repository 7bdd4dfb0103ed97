"""Multi-turn episodes, token in and token out, over any engine that continues token-id sequences.

An episode is one completion for GRPO: the model's turns and what the environment adds between them (tool results
and the template's turn markers), in the order the engine saw them. Every sampled token is kept as sampled; what
the environment adds is rendered once (grpo_cli.env.formats.ToolFormat.environment_pieces), tokenized, and its ids
appended: a tool's result, like each message of the prompt, with special-token strings kept as text, so only the
template's own text around it is control tokens. Nothing is decoded and encoded again, so the ids the trainer
scores are the ids the engine continued from, even where the tokenizer would encode the same text otherwise (a word
sampled as two tokens that it would encode as one).

The engine contract: `continue_batch(sequences, max_new) -> new ids per sequence`, each row stopping at its EOS
(kept as its last id) or after `max_new` ids, and `eos_token_id`. An engine with its own copy of the weights (vLLM)
also sets `logprobs` at each call: per row, its log-prob of each id it returned (the policy's plain softmax, as
`Rollout.sampling_logp`); the episode keeps them beside the ids, 0 on the environment's ids (never scored). An
engine that samples from the policy itself (HF generate) has none. Episodes are batched across the rows still
running: one engine call per round, every running episode one turn further.

An episode ends when the model answers without a tool call (`answer`), or at a limit:
- `env.max_turns`: assistant turns; the calls of the last allowed turn are not run (no turn would read them);
- `env.max_tool_calls`: calls run in the episode; a turn whose calls would pass it ends the episode unrun;
- `env.max_episode_tokens`, the budget: every token after the prompt counts, the sampled ones and the ones the
  environment adds (as TRL's `max_completion_length` counts a multi-turn completion). A turn samples at most what
  is left; a turn cut by the budget ends the episode (`budget`), its calls unrun. A tool turn that would leave no
  room for one more sampled token is rolled back, as TRL drops it: its results are replaced by an error saying
  they did not fit (a failure each, `Episode.overflows` counts such turns), so the model may go on with what is
  left; when even that turn does not fit, the episode ends (`budget`) without it, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo_cli.env.formats import Pieces, ToolFormat
from grpo_cli.env.limits import Limits
from grpo_cli.env.tools import Toolbox, ToolResult, error_text


class Engine(Protocol):
    eos_token_id: int

    def continue_batch(self, sequences: list[list[int]], max_new: int) -> list[list[int]]: ...


@dataclass(frozen=True)
class EpisodeCounts:
    """What the step's metrics read of an episode (grpo_cli.metrics.stats.episode_metrics): its counts, which pickle
    where the episode's environment instance need not, so every rank's can be gathered."""

    tool_calls: int
    tool_failures: int
    turns: int
    sampled: list[int]  # [T] 1 where the model sampled the id, 0 where the environment added it


@dataclass
class Episode:
    """One episode's record: the ids the engine saw and who wrote each."""

    prompt_ids: list[int]
    toolbox: Toolbox
    # [T] every id after the prompt, in the engine's order: sampled turns and what the environment added
    completion_ids: list[int] = field(default_factory=list)
    # [T] 1 where the model sampled the id, 0 where the environment added it (masked out of the loss)
    sampled: list[int] = field(default_factory=list)
    # [T] the engine's log-prob of each sampled id, 0 on the environment's; None when the engine keeps none
    sampling_logp: list[float] | None = None
    # index into completion_ids of each assistant turn's last sampled id: where a per-turn reward sits
    turn_ends: list[int] = field(default_factory=list)
    # the assistant and tool messages, as TRL hands a multi-turn completion to reward functions
    messages: list[dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    # tool turns whose results did not fit the budget: rolled back, the model told instead
    overflows: int = 0
    # why it ended: answer, max_turns, max_tool_calls or budget
    stop: str = ""
    # env=class with get_reward: the environment's score of the episode (None: it gave none), its class's name,
    # and why it gave none
    environment_reward: float | None = None
    scored_by: str | None = None
    environment_reward_error: str | None = None

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    def counts(self) -> EpisodeCounts:
        return EpisodeCounts(self.tool_calls, self.tool_failures, self.turns, list(self.sampled))

    @property
    def environment(self) -> Any:
        """The `env=class` instance of this episode (reward functions read it, as TRL's `environments`)."""
        return self.toolbox.environment

    def add(self, ids: list[int], sampled: bool, logp: list[float] | None = None) -> None:
        """Append `ids`: sampled (with the engine's `logp` of each, when it keeps them) or the environment's."""
        if logp is not None and self.sampling_logp is None and not self.completion_ids:
            self.sampling_logp = []  # the engine keeps log-probs: from the first turn on
        if self.sampling_logp is not None:
            self.sampling_logp.extend(logp if sampled and logp is not None else [0.0] * len(ids))
        self.completion_ids.extend(ids)
        self.sampled.extend([int(sampled)] * len(ids))


def run_episodes(engine: Engine, tokenizer: Any, fmt: ToolFormat, prompts: list[list[dict]],
                 toolboxes: list[Toolbox], limits: Limits) -> list[Episode]:
    """One episode per prompt (messages, with any first observation already in), each with its own toolbox."""
    episodes = [Episode(encode(tokenizer, fmt.prompt_pieces(tokenizer, p, box.schemas)), box)
                for p, box in zip(prompts, toolboxes, strict=True)]
    running = list(range(len(episodes)))
    while running:
        room = [limits.max_episode_tokens - len(episodes[i].completion_ids) for i in running]
        new = engine.continue_batch([episodes[i].prompt_ids + episodes[i].completion_ids for i in running], max(room))
        logps = getattr(engine, "logprobs", None) or [None] * len(new)  # per row, beside its ids
        running = [i for i, ids, logp, left in zip(running, new, logps, room, strict=True)
                   if _turn(episodes[i], list(ids)[:left], None if logp is None else list(logp)[:left],
                            engine.eos_token_id, tokenizer, fmt, limits)]
    for ep in episodes:  # the environment scores its episode before its instance goes back to the pool
        if ep.toolbox.reward is not None:
            ep.environment_reward, ep.environment_reward_error = ep.toolbox.reward()
            ep.scored_by = type(ep.environment).__name__
    return episodes


def environment_rewards(episodes: list[Episode]) -> list[tuple[str, float | None, bool] | None]:
    """Per episode, its environment's own score as a reward source: (class name, score or None, whether
    get_reward failed), or None where the environment does not score itself (or the episode has none). A list per
    completion, as the other episode columns, so two rollouts' columns join with `+`."""
    return [None if ep.scored_by is None else (ep.scored_by, ep.environment_reward,
                                               ep.environment_reward_error is not None) for ep in episodes]


def _turn(ep: Episode, ids: list[int], logp: list[float] | None, eos: int, tokenizer: Any, fmt: ToolFormat,
          limits: Limits) -> bool:
    """Record one sampled turn and, when it calls tools, their results; True while the episode goes on."""
    ep.add(ids, sampled=True, logp=logp)
    if ids:
        ep.turn_ends.append(len(ep.completion_ids) - 1)
    ended = bool(ids) and ids[-1] == eos
    text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
    calls = fmt.parse(text)
    message: dict = {"role": "assistant", "content": text}
    good = [c for c in calls if c.error is None]
    if good:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in good]
    ep.messages.append(message)
    if not ended:
        ep.stop = "budget"
        return False
    if not calls:
        ep.stop = "answer"
        return False
    if ep.turns >= limits.max_turns:
        ep.stop = "max_turns"
        return False
    if ep.tool_calls + len(calls) > limits.max_tool_calls:
        ep.stop = "max_tool_calls"
        return False
    results: list[ToolResult] = [ep.toolbox.call(c, limits.tool_timeout_s, limits.max_result_chars) for c in calls]
    ep.tool_calls += len(results)
    ep.tool_failures += sum(r.failed for r in results)
    eos_text = tokenizer.decode([eos], skip_special_tokens=False)
    added = encode(tokenizer, fmt.environment_pieces(tokenizer, ep.toolbox.schemas, results, eos_text))
    left = limits.max_episode_tokens - len(ep.completion_ids)
    if len(added) >= left:  # rolled back: the model is told instead, in a turn that fits (else the episode ends)
        newly = sum(not r.failed for r in results)
        results = [ToolResult(r.name, error_text(f"the result of {r.name} ({len(r.text)} characters) did not fit in "
                                             f"what is left of this episode ({left} tokens) and was dropped; ask "
                                             f"for less"), True) for r in results]
        added = encode(tokenizer, fmt.environment_pieces(tokenizer, ep.toolbox.schemas, results, eos_text))
        if len(added) >= left:
            ep.stop = "budget"
            return False
        ep.overflows += 1
        ep.tool_failures += newly
    ep.add(added, sampled=False)
    ep.messages.extend({"role": "tool", "name": r.name, "content": r.text} for r in results)
    return True


def encode(tokenizer: Any, pieces: Pieces) -> list[int]:
    """The ids of rendered pieces: a message's text with special-token strings kept as text (a tool's result
    cannot open a turn), the template's own text with its control tokens; no BOS or EOS added on top."""
    return [i for text, message in pieces
            for i in tokenizer(text, add_special_tokens=False, split_special_tokens=message)["input_ids"]]
