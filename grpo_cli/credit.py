"""Credit: which tokens a rollout's rewards pay, as one typed record, `TokenRewards`, and the advantages it gives.

    rewards = token_rewards(result, rollout, tokenizer)     # right after scoring: text-level -> token-level
    adv = advantages(rewards, group_size, scale, std, world, estimator=...)   # [N] outcome or [N, T] process

A reward call (`rewards.RewardResult`) speaks of texts: one reward per completion, step rewards at character ends,
or one reward per assistant turn of an episode. `token_rewards` puts them on the rollout's tokens once: outcome
rewards [N], and step rewards as a sparse [N, T] in coordinate form (`objective.step_coordinates`), each on the
completion token that ends its step, with the weight λ that mixes the two. `advantages` is then the paper's
arithmetic on those tensors (grpo_cli.objective), with the outcome rewards of every rank gathered first.

What follows DeepSeekMath (arXiv 2402.03300) §4.1: outcome supervision gives every token of a completion its
group-normalized reward (`objective.outcome_advantages`; the [N] advantages broadcast over the tokens in the loss);
process supervision normalizes the step rewards over all steps of the group, and a token's advantage is the sum of
the normalized rewards of the steps ending at or after it (`objective.sparse_process_advantages`).

Where it departs, and why:
  - a process-supervised completion's final step ends at its last token (its EOS), not at the token holding its
    last character: at its last character the EOS after it got advantage 0, so stopping was never penalized while
    writing on was (docs/process-supervision.md). A step whose character end is past the text (len + 1) ends there
    too;
  - an episode's turns are its steps (a reward per assistant turn, on the turn's last sampled token); the tokens an
    environment added get advantage 0 (context, never scored);
  - with a finite `process_weight` λ a process reward also carries outcome rewards: A = A_outcome + λ·A_process,
    each normalized on its own within the group (PRIME, arXiv 2502.01456; PURE, 2504.15275);
  - `credit="min"` (PURE's min-form) instead of the sum: objective/advantages.py says how;
  - a reward of None (no score) is NaN here: out of every mean and std, advantage 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_cli.distributed import SINGLE, World
from grpo_cli.objective import outcome_advantages, sparse_process_advantages, step_coordinates
from grpo_cli.rewards.result import RewardResult
from grpo_cli.rollout import Rollout


@dataclass(frozen=True)
class TokenRewards:
    """A rollout's rewards on its tokens: what the advantages are computed from, on the CPU.

    Outcome only: `outcome`. Process only: the step fields. Both: all of them and `process_weight` λ.
    """

    shape: tuple[int, int]                 # (N, T): the rollout's rows and padded completion width
    outcome: torch.Tensor | None = None    # [N] float32 outcome rewards, NaN: no score; None: process only
    # step rewards as a sparse [N, T] in coordinate form (objective.step_coordinates): step_rewards[s] sits on token
    # step_tokens[s] of row step_rows[s]; steps sharing a token stay entries of their own. None: outcome only
    step_rows: torch.Tensor | None = None    # [S] long
    step_tokens: torch.Tensor | None = None  # [S] long, in [0, T)
    step_rewards: torch.Tensor | None = None  # [S] float32, NaN: no score
    process_weight: float | None = None    # λ of A = A_outcome + λ·A_process; None unless both are held
    credit: str = "sum"                    # how a token gathers the steps after it: sum (the paper's) or min (PURE)
    # [N, T] 1 where a step's credit lands (an episode's sampled tokens), 0 on the environment's; None: every token
    credited: torch.Tensor | None = None

    def __post_init__(self):
        steps = self.step_rewards is not None
        if self.outcome is None and not steps:
            raise ValueError("TokenRewards holds outcome rewards, step rewards or both: it got neither")
        if (self.process_weight is not None) != (self.outcome is not None and steps):
            raise ValueError("process_weight mixes outcome and step rewards: give it exactly when both are held")


def token_rewards(result: RewardResult, rollout: Rollout, tokenizer) -> TokenRewards:
    """`result` on `rollout`'s tokens: per-turn rewards on their turns' last sampled tokens, step rewards on the
    tokens that end their steps (through `tokenizer`), outcome rewards as they are (None -> NaN)."""
    if result.turns is not None:
        return _by_turn(result.turns, rollout)
    if result.steps is None:
        return TokenRewards(_shape(rollout), outcome=_tensor(result.rewards))
    ends = _step_ends(result.steps, rollout, tokenizer)
    rows, tokens, rewards = step_coordinates([[r for _, r in steps] for steps in result.steps], ends,
                                             rollout.completion_ids.shape[1])
    mixed = result.process_weight is not None  # process only: the paper's form (ProcessReward turns inf into None)
    return TokenRewards(_shape(rollout), outcome=_tensor(result.outcome) if mixed else None,
                        step_rows=rows, step_tokens=tokens, step_rewards=rewards,
                        process_weight=result.process_weight, credit=result.credit)


def advantages(rewards: TokenRewards, group_size: int, scale: str, std: str, world: World = SINGLE, *,
               estimator: str = "grpo") -> torch.Tensor:
    """[N] outcome advantages, [N, T] process advantages, or [N, T] A_outcome + λ·A_process.

    Outcome rewards of every rank are gathered first (scale=batch reads them all) and this rank's slice of the
    advantages is returned; step rewards are normalized per group, on this rank (a group's rows share a rank).
    `estimator` (algo.advantage: grpo, rloo) is the outcome rewards' baseline; step rewards keep the paper's.
    """
    process = None
    if rewards.step_rewards is not None:
        process = sparse_process_advantages(rewards.step_rewards, rewards.step_rows, rewards.step_tokens,
                                            rewards.shape, group_size, credit=rewards.credit)  # [N, T]
        if rewards.credited is not None:
            process = process * rewards.credited.to(process.dtype)
        if rewards.outcome is None:
            return process
    everyone = world.cat(rewards.outcome)  # [N · world size], rank order
    outcome = outcome_advantages(everyone, group_size, scale=scale, std=std, estimator=estimator)
    outcome = outcome[world.slice(everyone.numel())]  # [N], every token alike
    return outcome if process is None else outcome[:, None] + rewards.process_weight * process


def _shape(rollout: Rollout) -> tuple[int, int]:
    """(N, T): the rollout's rows and padded completion width."""
    n, t = rollout.completion_ids.shape
    return n, t


def _tensor(rewards: list[float | None]) -> torch.Tensor:
    """[N] float32 rewards, None -> NaN (no score)."""
    return torch.tensor([math.nan if r is None else r for r in rewards], dtype=torch.float32)


def _step_ends(steps: list[list[tuple[int, float]]], rollout: Rollout, tokenizer) -> list[list[int]]:
    """Per row, the completion token that ends each step: the token holding the step's last character, or the
    completion's last token (its EOS) for the final step and any step past the text."""
    out = []
    completion_ids, keep = rollout.completion_ids.cpu(), rollout.completion_mask.cpu().bool()  # one host copy
    for row, row_steps in enumerate(steps):
        ids = completion_ids[row][keep[row]].tolist()
        text_end = len(rollout.texts[row])
        # a step at char_end len(text) + 1 ends with the completion: on its last token (its EOS), the decision to
        # stop; the others on the token holding their last character. Several steps may share a token (the
        # answer's step and the unwritten slots): each stays a step of its own in the group's mean and std
        inside = [end for end, _ in row_steps if end <= text_end]
        ends = char_ends_to_token_index(tokenizer, ids, inside) if inside else []
        ends += [len(ids) - 1] * (len(row_steps) - len(inside))
        if ends and len(inside) == len(row_steps):
            # no step ends with the completion: the last one does (with any sharing its token). At its last
            # character instead, the EOS after it got advantage 0, so stopping was never penalized while writing on
            # was (docs/process-supervision.md)
            last = ends[-1]
            ends = [len(ids) - 1 if t == last else t for t in ends]
        out.append(ends)
    return out


def _by_turn(turns: list[list[float | None]], rollout: Rollout) -> TokenRewards:
    """An episode's assistant turns as its steps: each turn's reward on the turn's last sampled token
    (`Episode.turn_ends`); the environment's tokens get none of the credit (`credited`). A row with fewer rewards
    than turns holds its last turns' (an episode's one number: its last turn)."""
    rewards = [[math.nan if r is None else r for r in row] for row in turns]
    ends = [episode.turn_ends[len(episode.turn_ends) - len(row):] if row else []
            for episode, row in zip(rollout.episodes, turns, strict=True)]
    rows, tokens, values = step_coordinates(rewards, ends, rollout.completion_ids.shape[1])
    return TokenRewards(_shape(rollout), step_rows=rows, step_tokens=tokens, step_rewards=values,
                        credited=rollout.sampled_mask.cpu())


def char_ends_to_token_index(tokenizer, completion_ids: list[int], char_ends: list[int]) -> list[int]:
    """Index of the completion token that holds each character end (exclusive end -> its last char).

    Exact: it decodes token prefixes the same way the completion text was decoded, so a multi-byte
    or multi-character token maps correctly. Binary search keeps it at O(K log T) decodes.
    """
    cache: dict[int, int] = {}

    def text_len(j: int) -> int:  # characters decoded from tokens [0, j]
        if j not in cache:
            cache[j] = len(tokenizer.decode(completion_ids[: j + 1], skip_special_tokens=True))
        return cache[j]

    out = []
    for end in char_ends:
        lo, hi = 0, len(completion_ids) - 1
        while lo < hi:  # first token whose prefix covers `end` characters
            mid = (lo + hi) // 2
            if text_len(mid) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out
