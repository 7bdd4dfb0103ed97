"""Advantages Â from the rewards of a rollout: outcome supervision (one reward per completion) and process
supervision (one reward per reasoning step).

What follows DeepSeekMath (arXiv 2402.03300) §4.1:
  - outcome supervision: Â_i,t = (r_i - mean(r)) / std(r) over the G completions of a prompt,
    with the population std (1/G) of the paper's formula;
  - process supervision: every step reward is normalized by the mean and std of all step rewards
    of the group, and a token's advantage is the sum of the normalized rewards of the steps that
    end at or after it.

Where it departs, and why:
  - `eps` is added to the std (the paper has none) so a group whose rewards are all equal gets
    advantage 0 instead of 0/0;
  - a NaN reward means "no score" (a reward model that failed, a filtered sample): it is left out of
    the group's mean and std and its completion gets advantage 0;
  - options the paper does not have, each from a follow-up: `std="sample"` (TRL, verl),
    `scale="batch"` (std of the whole batch) and `scale="none"` (Dr. GRPO);
  - `estimator="rloo"`: RLOO's baseline (Ahmadian et al., arXiv 2402.14740; verl's "rloo"), each reward minus
    the mean of the other G-1 of its group, divided by no std;
  - `credit="min"` for step rewards: PURE's min-form credit (Cheng et al., arXiv 2504.15275), a token's advantage
    is the minimum of the normalized rewards of the steps ending at or after it instead of their sum, so a good
    step cannot pay for a bad one after it. PURE takes a soft minimum (weights softmax(-r/T), T -> 0 is the
    minimum) of the raw PRM scores and then subtracts an RLOO baseline over the returns; here the hard minimum
    (T -> 0) of the paper's group-normalized step rewards, keeping DeepSeekMath's normalization. The
    normalization is increasing, so the minimum picks the same step either way; what differs from PURE is the
    baseline (the group's mean step reward, not the mean return of the other completions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from grpo_cli.objective.options import choose


def _group_std(r0: torch.Tensor, valid: torch.Tensor, centered: torch.Tensor, ddof: int) -> torch.Tensor:
    """[groups, G] -> [groups, 1]: the std of each group's scored rewards (the paper's)."""
    count = valid.sum(1, keepdim=True)                   # [groups, 1]
    return (centered.pow(2).sum(1, keepdim=True) / (count - ddof).clamp(min=1)).sqrt()


def _batch_std(r0: torch.Tensor, valid: torch.Tensor, centered: torch.Tensor, ddof: int) -> torch.Tensor:
    """[groups, G] -> 0-dim: the std of every scored reward of the batch, about the batch mean (TRL's
    scale_rewards="batch")."""
    scored = r0[valid]                                   # [scored rewards]
    centered_batch = scored - scored.mean() if scored.numel() else scored
    return (centered_batch.pow(2).sum() / max(scored.numel() - ddof, 1)).sqrt()


# scale -> the std an advantage is divided by (none: not divided, Dr. GRPO)
ADVANTAGE_SCALES: dict[str, Callable[..., torch.Tensor] | None] = {"group": _group_std, "batch": _batch_std,
                                                                   "none": None}
SCALES = tuple(ADVANTAGE_SCALES)
def _group_mean_baseline(centered: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return centered                                      # r_i - mean of the group (GRPO)


def _leave_one_out_baseline(centered: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """r_i - mean of the other c-1 scored rewards = c/(c-1)·(r_i - mean); 0 without another scored reward."""
    return torch.where(count > 1, centered * count / (count - 1).clamp(min=1), 0.0)


# algo.advantage -> (centered [groups, G], scored count [groups, 1]) -> the rewards minus the estimator's baseline
ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "grpo": _group_mean_baseline, "rloo": _leave_one_out_baseline}
ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)
# the estimators that divide by no std: with one, only scale "none" makes sense
UNSCALED_ESTIMATORS = ("rloo",)
# std -> the degrees of freedom it subtracts: population 1/G (the paper's formula), sample 1/(G-1) (TRL, verl)
STD_DDOF = {"population": 0, "sample": 1}
STDS = tuple(STD_DDOF)


def outcome_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale: str = "group",
    std: str = "population",
    eps: float = 1e-4,
    estimator: str = "grpo",
) -> torch.Tensor:
    """[N] rewards, groups of `group_size` contiguous completions -> [N] advantages.

    (r_i - group mean) / (std + eps). `scale`: "group" (paper) divides by the std of the group,
    "batch" by the std of all rewards of the batch (the mean stays per group), "none" does not
    divide. `std`: "population" (1/G, the paper's formula) or "sample" (1/(G-1), TRL and verl).
    `estimator="rloo"`: r_i - mean of the other rewards of the group (= G/(G-1)·(r_i - group mean)), with
    scale "none" only (divided by a std it would be GRPO's advantage times G/(G-1)).
    NaN rewards are left out of every mean and std and get advantage 0.
    """
    std_of = choose("scale", scale, ADVANTAGE_SCALES)
    ddof = choose("std", std, STD_DDOF)
    baseline = choose("estimator", estimator, ADVANTAGE_ESTIMATORS)
    if estimator in UNSCALED_ESTIMATORS and std_of is not None:
        raise ValueError(f"estimator {estimator!r} divides by no std: pass scale='none', not {scale!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size ({group_size}) must be >= 1")
    n = rewards.numel()
    if n % group_size:
        raise ValueError(
            f"number of rewards ({n}) is not a multiple of group_size ({group_size}): "
            "each prompt needs exactly group_size completions, stored contiguously"
        )
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    # float64 inside: the variance of rewards of ±1e30 overflows float32 (and would zero the advantages)
    r = rewards.to(torch.float64).reshape(-1, group_size)  # [groups, G]
    valid = ~torch.isnan(r)                              # [groups, G]; False = no score
    r0 = torch.where(valid, r, 0.0)
    count = valid.sum(1, keepdim=True)                   # [groups, 1]
    mean = r0.sum(1, keepdim=True) / count.clamp(min=1)  # [groups, 1]; 0 for an all-NaN group
    centered = baseline(torch.where(valid, r0 - mean, 0.0), count)   # [groups, G]; 0 where no score
    if std_of is None:
        return centered.view(-1).to(dtype)
    return (centered / (std_of(r0, valid, centered, ddof) + eps)).view(-1).to(dtype)


def _sum_of_steps_after(per_step: torch.Tensor, row: torch.Tensor, end: torch.Tensor, n: int,
                        length: int) -> torch.Tensor:
    """[S] normalized step rewards at (row, end) -> [N, length]: Â[i, t] = Σ of row i's steps ending at or after t
    (DeepSeekMath §4.1.3); 0 past the last step. A NaN step (no score) adds 0."""
    out = torch.zeros(n, length, dtype=per_step.dtype)                  # [N, length]
    out.index_put_((row, end), torch.nan_to_num(per_step, nan=0.0), accumulate=True)
    return out.flip(1).cumsum(1).flip(1)                                # a reverse cumsum


def _min_of_steps_after(per_step: torch.Tensor, row: torch.Tensor, end: torch.Tensor, n: int,
                        length: int) -> torch.Tensor:
    """[S] normalized step rewards at (row, end) -> [N, length]: Â[i, t] = min of row i's steps ending at or after t
    (PURE's min-form); 0 past the last step. A NaN step (no score) is no candidate for the minimum."""
    out = torch.full((n, length), float("inf"), dtype=per_step.dtype)  # [N, length]; inf = no step here
    scored = torch.where(torch.isnan(per_step), float("inf"), per_step)
    flat = out.view(-1).scatter_reduce(0, row * length + end, scored, reduce="amin")
    after = flat.view(n, length).flip(1).cummin(1).values.flip(1)      # a reverse cummin
    return torch.where(torch.isinf(after), 0.0, after)


# reward.credit -> how a token's advantage gathers the normalized rewards of the steps ending at or after it
CREDIT_FORMS: dict[str, Callable[..., torch.Tensor]] = {"sum": _sum_of_steps_after, "min": _min_of_steps_after}
CREDITS = tuple(CREDIT_FORMS)


def step_coordinates(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-completion step rewards and end tokens -> the batch's steps as a sparse [N, length] in coordinate form:
    (rows [S], tokens [S], rewards [S]), S = all steps, in row then text order; step s's reward sits on token
    tokens[s] of completion rows[s]. Several steps may share a token and each stays an entry of its own (a dense
    [N, length] could not hold them apart).

    `step_rewards[i]` are the K_i step rewards of completion i, `step_ends[i]` the completion-token index of the last
    token of each step (non-decreasing, in [0, length)). rewards float32 (the default dtype), NaN = no score; all on
    the CPU.
    """
    if len(step_ends) != len(step_rewards):
        raise ValueError(f"step_rewards has {len(step_rewards)} completions but step_ends has {len(step_ends)}")
    if length < 0:
        raise ValueError(f"length ({length}) must be >= 0")
    rows, ends, values = [], [], []
    for i, (rs, es) in enumerate(zip(step_rewards, step_ends)):
        if len(rs) != len(es):
            raise ValueError(f"completion {i} has {len(rs)} step rewards but {len(es)} step ends")
        prev = -1
        for e in es:
            if int(e) != e or e < prev or e < 0 or e >= length:
                raise ValueError(
                    f"completion {i}: step ends {list(es)} must be integers, non-decreasing, "
                    f"in [0, {length}) (token indices within the completion)"
                )
            prev = e
        rows += [i] * len(rs)
        ends += [int(e) for e in es]
        values += [float(v) for v in rs]
    dtype = torch.get_default_dtype()
    return (torch.tensor(rows, dtype=torch.long), torch.tensor(ends, dtype=torch.long),
            torch.tensor(values, dtype=dtype))


def sparse_process_advantages(
    rewards: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    shape: tuple[int, int],
    group_size: int,
    *,
    eps: float = 1e-4,
    credit: str = "sum",
) -> torch.Tensor:
    """Step rewards as a sparse [N, T] in coordinate form (`step_coordinates`: rewards, rows, tokens [S]) ->
    [N, T] per-token advantages (DeepSeekMath §4.1.3), `shape` = (N, T).

    Within each group of `group_size` contiguous completions every step reward is normalized by the mean and
    population std of all step rewards of the group (a step sharing its token with another counts on its own);
    token t of completion i gets the sum of its normalized step rewards whose step ends at or after t, so tokens
    after the last step end get 0 (`credit="sum"`, the paper's); `credit="min"`: the minimum of them instead
    (PURE). NaN step rewards are left out like NaN outcome rewards (normalized to 0 in the sum, no candidate for
    the minimum). Returns rewards' dtype on the CPU.
    """
    gather = choose("credit", credit, CREDIT_FORMS)
    n, length = shape
    if group_size < 1:
        raise ValueError(f"group_size ({group_size}) must be >= 1")
    if n % group_size:
        raise ValueError(
            f"number of completions ({n}) is not a multiple of group_size ({group_size}): "
            "each prompt needs exactly group_size completions, stored contiguously"
        )
    dtype = rewards.dtype
    if not rewards.numel():
        return torch.zeros(n, length, dtype=dtype)      # [N, T]
    r, row, end = rewards.cpu(), rows.cpu(), tokens.cpu()   # [S] each
    group = row // group_size                            # [S]
    groups = n // group_size

    valid = ~torch.isnan(r)
    r0 = torch.where(valid, r, 0.0)
    count = torch.zeros(groups, dtype=dtype).index_add_(0, group, valid.to(dtype))   # [groups]
    mean = torch.zeros(groups, dtype=dtype).index_add_(0, group, r0) / count.clamp(min=1)
    centered = torch.where(valid, r0 - mean[group], 0.0)                             # [S]
    var = torch.zeros(groups, dtype=dtype).index_add_(0, group, centered.pow(2)) / count.clamp(min=1)
    normalized = centered / (var.sqrt()[group] + eps)                                # [S]
    # each normalized step reward at its last token, then gathered over the steps ending at or after each token
    return gather(torch.where(valid, normalized, float("nan")), row, end, n, length)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    group_size: int,
    length: int,
    *,
    eps: float = 1e-4,
    credit: str = "sum",
) -> torch.Tensor:
    """Per-step rewards of N completions -> [N, length] per-token advantages (DeepSeekMath §4.1.3): the lists'
    form of `sparse_process_advantages`.

    `step_rewards[i]` are the K_i step rewards of completion i, `step_ends[i]` the completion-token
    index of the last token of each step (non-decreasing, < length: several steps may end on one token,
    each counted on its own in the group's mean and std, e.g. a final answer's step and the reference
    steps a completion never wrote, all at its last token). Within each group every
    step reward is normalized by the mean and population std of all step rewards of the group;
    token t of completion i gets the sum of its normalized step rewards whose step ends at or after
    t, so tokens after the last step end get 0 (`credit="sum"`, the paper's); `credit="min"`: the minimum of
    them instead (PURE). NaN step rewards are left out like NaN outcome rewards (normalized to 0 in the sum,
    no candidate for the minimum). Returns float32 (the default dtype) on the CPU.
    """
    choose("credit", credit, CREDIT_FORMS)
    rows, tokens, rewards = step_coordinates(step_rewards, step_ends, length)
    return sparse_process_advantages(rewards, rows, tokens, (len(step_rewards), length), group_size, eps=eps,
                                     credit=credit)
