"""One step's learning, in two halves (as torchtune's GRPO recipe splits it):

    batch = prepare(policy, rollout, advantages, loss, μ, micro_batch_size, ...)  # what the loss needs, no gradient
    stats = update(policy, optimizer, scheduler, batch)  # μ passes of micro-batches -> loss -> backward -> step

Within a micro-batch, `logprobs.buckets` runs each prompt once and the completions in length buckets;
the update back-propagates each bucket's loss as soon as it is made (the loss is a sum over rows), so
the peak holds one bucket's activations. `UpdateStats.metrics()` is what the step logs.

`prepare` gathers what the loss declares it reads (`objective.Loss`): the token mask, the rows that carry a
gradient, the reference log-probs (adapter off, or its frozen copy in iterative RL; only when β > 0), the
old-policy log-probs (only when μ > 1) and, with `algo.top_entropy_quantile` < 1, the batch's entropy threshold
(over all ranks, from the policy before the update: one more forward when μ = 1), all with dropout off, so that the
update only loops over micro-batches and their losses add up to the batch's whatever micro_batch_size and the
number of ranks. The `Batch` carries the loss, μ and the micro-batch size with it. The advantages it takes
([N] outcome or [N, T] process) come from grpo_cli.credit, which puts the rewards on the tokens.

Where it departs from the paper: rows whose advantage is zero everywhere are skipped when β = 0
(they carry no gradient, so this changes time, not numbers); LoRA adapters instead of full weights.

With N ranks (grpo_cli.distributed) each rank holds its slice of the batch; the counts the loss
divides by (and, in grpo_cli.credit, the outcome rewards the advantages normalize over) are the whole batch's, and
the gradients are summed once per optimizer step, so N ranks take the 1-rank step on the same batch.
With the base sharded (trainer.fsdp, grpo_cli.fsdp) every rank also runs as many rows as the busiest one, its
spare rows masked out of the loss (`Batch.fillers`): FSDP's per-layer gathers need the same passes everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo_cli.distributed import SINGLE, World
from grpo_cli.fsdp import local, lockstep, sharded, sharded_weights, whole_tensor
from grpo_cli.logprobs import BUCKET_ROWS, buckets, sequence_logprobs
from grpo_cli.objective import Loss, high_entropy_threshold, masked_mean
from grpo_cli.policy import reference
from grpo_cli.rollout import Rollout


@dataclass
class Batch:
    """What the loss needs for one rollout, gathered before any gradient is taken, and how the update runs it."""

    rollout: Rollout
    loss: Loss  # what the update minimizes (objective.GRPOLoss, built from the algo section)
    num_iterations: int  # μ: optimizer steps over this batch
    micro_batch_size: int  # rows per forward/backward (the update's micro-batches; prepare's forwards too)
    advantages: torch.Tensor  # [N] outcome or [N, T] process, on the policy's device
    mask: torch.Tensor  # [N, T] float; 1 on completion tokens that count in the loss
    active: list[int]  # rows that go through forward/backward
    ref_logp: torch.Tensor | None  # [N, T] reference policy (adapter off); None when β = 0
    old_logp: torch.Tensor | None  # [N, T] sampling-time policy; None when μ = 1 (old = current)
    num_sequences: int  # N of the whole batch (all ranks): the grpo/dr_grpo mean is over it
    num_tokens: torch.Tensor  # counted tokens of the whole batch (all ranks): the bnpo/dapo mean is over them
    max_length: int  # the longest padded completion of all ranks, in sampled tokens: dr_grpo's constant divisor
    world: World = SINGLE
    # 0-dim: the entropy at or above which a token keeps its policy-gradient term (top_entropy_quantile < 1)
    entropy_threshold: torch.Tensor | None = None
    # a sharded base (trainer.fsdp): rows run after `active` with a zero loss mask, so every rank runs the same
    # forwards and backwards (grpo_cli.fsdp.lockstep); [] otherwise
    fillers: list[int] = field(default_factory=list)
    # rows per length bucket of the update's forward/backward (`logprobs.buckets`): one bucket's activations are the
    # update's peak, so long completions take fewer rows (`bucket_rows_for`); the same on every rank
    bucket_rows: int = BUCKET_ROWS


def bucket_rows_for(width: int, bucket_tokens: int | None, most: int = BUCKET_ROWS) -> int:
    """Rows per update bucket for completions padded to `width` tokens: as many as fit `bucket_tokens` tokens
    (rows × width), at least 1 and at most `most`; None: `most`.

    1024 tokens, `most` 8: width 64 -> 8 rows, 256 -> 4, 2048 -> 1.
    """
    if bucket_tokens is None:
        return most
    return max(1, min(most, bucket_tokens // max(width, 1)))


def micro_batches(rows: list[int], size: int) -> list[list[int]]:
    """`rows` in consecutive chunks of at most `size`."""
    return [rows[i:i + size] for i in range(0, len(rows), size)]


@torch.no_grad()
def prepare(policy, rollout: Rollout, advantages: torch.Tensor, loss: Loss, num_iterations: int,
            micro_batch_size: int, mask_truncated_completions: bool, world: World = SINGLE,
            bucket_tokens: int | None = None, frozen=None) -> Batch:
    """The Batch for `rollout`: masks, active rows, what `loss` declares it reads (reference and old log-probs, the
    entropy threshold; dropout off), and the rows per update bucket for `bucket_tokens` (`bucket_rows_for`, from the
    longest padded completion of all ranks); `num_iterations` (μ) and `micro_batch_size` travel with it. `frozen`: a
    full-parameter policy's reference (policy.keep_reference)."""
    device = rollout.completion_ids.device
    advantages = advantages.to(device)
    # [N, T]; 1 on the sampled tokens up to and including EOS: an episode's environment tokens are context only, out
    # of the loss, the KL, the entropy and the counts the loss divides by
    mask = rollout.loss_mask.float()
    if mask_truncated_completions:
        mask[torch.tensor(rollout.truncated, device=device)] = 0.0
    n = mask.shape[0]
    was_training = policy.training
    policy.eval()  # the log-probs the ratio and the KL compare against are the policy's, not a dropout sample
    ref_logp = None
    if loss.needs_reference:
        # the base model (adapter off), the adapter copied at the iteration's start, or full's frozen copy
        with reference(policy, frozen) as ref:
            ref_logp = torch.cat([sequence_logprobs(ref, rollout.take(b)).logp
                                  for b in micro_batches(list(range(n)), micro_batch_size)])
    # rows with zero advantage everywhere carry no gradient when β = 0: skip their forward/backward
    if loss.needs_reference:
        active = list(range(n))
    else:
        carries = advantages.reshape(n, -1).ne(0).any(1) & mask.bool().any(1)  # [N]
        active = carries.nonzero().flatten().tolist()
    # a sharded base: every rank runs as many rows as the busiest one (its own spare rows, masked out of the loss)
    run, fillers = lockstep(active, n, world) if sharded(policy) else (active, [])
    old_logp = None
    top_entropy = loss.entropy_quantile is not None  # the batch's entropy threshold, from the policy before the update
    entropy = torch.zeros_like(mask) if top_entropy else None  # [N, T]; 0 on rows that are not updated
    # π_old: with μ = 1 the policy of the only pass, detached in the update; with μ > 1 the policy before the first
    old_needed = loss.needs_old_logprobs and num_iterations > 1
    if (old_needed or top_entropy) and run:
        old_logp = torch.zeros_like(mask) if old_needed else None
        for b in micro_batches(run, micro_batch_size):
            scored = sequence_logprobs(policy, rollout.take(b), with_entropy=top_entropy)
            if old_logp is not None:
                old_logp[b] = scored.logp
            if top_entropy:
                entropy[b] = scored.entropy
    threshold = None
    if top_entropy:
        rows = torch.zeros(n, dtype=torch.bool, device=device)
        rows[active] = True
        threshold = batch_entropy_threshold(entropy, mask.bool() & rows[:, None], loss.entropy_quantile, world)
    policy.train(was_training)
    # [2]: sequences and counted tokens of the whole batch; [2]: the longest padded completion of all ranks in
    # sampled tokens (dr_grpo's divisor) and in tokens (what a bucket's activations hold)
    counts = world.sum(torch.tensor([n, mask.sum().item()], dtype=torch.float64))
    length = world.max(torch.tensor([rollout.sampled_width, mask.shape[1]]))
    return Batch(rollout, loss, num_iterations, micro_batch_size, advantages, mask, active, ref_logp, old_logp,
                 int(counts[0]), counts[1].to(mask.dtype).to(device).clamp(min=1), int(length[0]), world, threshold,
                 fillers, bucket_rows_for(int(length[1]), bucket_tokens))


def batch_entropy_threshold(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                            world: World = SINGLE) -> torch.Tensor:
    """`objective.high_entropy_threshold` over the counted tokens of every rank: [N, T] -> 0-dim.

    Each rank's counted entropies, NaN-padded to the longest rank's count, are gathered (ranks hold
    different numbers of tokens); NaN positions do not count.
    """
    mine = entropy[mask.bool()].float()  # [K] this rank's counted tokens
    width = int(world.max(torch.tensor([mine.numel()]))[0])
    padded = torch.nn.functional.pad(mine, (0, width - mine.numel()), value=float("nan"))
    everyone = world.cat(padded)  # [world size · width]
    return high_entropy_threshold(everyone[None], ~everyone.isnan()[None], quantile).to(entropy.device)


@dataclass
class UpdateStats:
    """One step's update, as `update` returns it; `metrics()` is the record the step logs."""

    loss: float  # the batch loss (all ranks), averaged over the μ passes
    # the loss's statistics (`GRPOLoss.stat_names`: kl, clip ratios, ratio, the sampler's) and entropy, averaged
    # over the tokens updated on all ranks; 0 when no token was updated
    tokens: dict[str, float]
    grad_norm: float  # of the last pass, before clipping
    nonfinite_skipped: int  # passes that took no optimizer step (a NaN/inf loss, gradient or weight)
    backward_seqs: int  # rows through forward + backward, all ranks, all passes
    ref_forward_seqs: int  # rows through the reference forward; 0 when β = 0

    def metrics(self) -> dict[str, float]:
        return {"loss": self.loss, **self.tokens, "grad_norm": self.grad_norm,
                "nonfinite_skipped": self.nonfinite_skipped, "counts/backward_seqs": self.backward_seqs,
                "counts/ref_forward_seqs": self.ref_forward_seqs}


def step_or_undo(optimizer, params: list[torch.Tensor], world: World = SINGLE) -> bool:
    """`optimizer.step()`, undone when it leaves a weight non-finite (a finite gradient times the rate
    overflowed): the weights and the optimizer's state (AdamW's step count and moments) are put back, so
    the skipped step leaves no trace. Returns whether the step stands. Copies the trained weights and
    their state: a few MB of LoRA weights, or this rank's shards of a sharded full-parameter policy, whose
    ranks agree (`world`) so that all of them undo when one rank's shard went non-finite."""
    weights = [p.detach().clone() for p in params]
    state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
             for p in params if p in optimizer.state}
    optimizer.step()
    finite = torch.stack([local(p).isfinite().all() for p in params]).all()
    if sharded_weights(params):  # each rank checked its own shards
        finite = world.sum(torch.tensor([int(not finite)]))[0] == 0
    if bool(finite):
        return True
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    for p in params:
        if p in state:
            optimizer.state[p] = state[p]
        else:  # its first step: no state before it
            optimizer.state.pop(p, None)
    return False


def update(policy, optimizer, scheduler, batch: Batch, *, max_grad_norm: float | None = None,
           decoder=None) -> UpdateStats:
    """μ = batch.num_iterations optimizer steps over `batch` with its loss, in micro-batches of
    batch.micro_batch_size rows; returns the step's statistics. `max_grad_norm`: the gradient's norm is clipped to
    it (None: not clipped).

    Token-level statistics (kl, clip ratios, ratio, entropy) are averaged over the tokens that were
    updated, whatever the loss reports; `loss` is the batch loss, averaged over the μ passes.

    A pass whose loss or gradient norm is NaN/inf takes no optimizer (or scheduler) step, and one
    whose step would leave a weight non-finite is undone (`step_or_undo`): `nonfinite_skipped` counts
    them, and the weights and the optimizer's state stay what they were. `decoder`: the compiled decoder the
    forwards run (`grpo_cli.compiled`, trainer.compile); None: eager.
    """
    world, loss, num_iterations = batch.world, batch.loss, batch.num_iterations
    loss_fn = loss.for_batch(batch.num_sequences, batch.num_tokens, batch.max_length,
                             entropy_threshold=batch.entropy_threshold)
    # the loss reads the entropy (entropy bonus, top-entropy mask); the bonus differentiates it
    loss_entropy, entropy_grad = loss.needs_entropy, loss.needs_entropy_grad
    # tokens updated on all ranks: the token-level statistics are averaged over them
    local_tokens = batch.mask[batch.active].sum() if batch.active else batch.mask.new_zeros(())
    active_tokens = world.sum(local_tokens.detach().clone()).clamp(min=1)
    params = [p for p in policy.parameters() if p.requires_grad]
    # the fillers (sharded base only) run with a zero mask: no loss, no gradient, no statistics
    rows_run, loss_mask = batch.active + batch.fillers, batch.mask
    if batch.fillers:
        loss_mask = batch.mask.clone()
        loss_mask[batch.fillers] = 0.0
    # the token statistics: 0-dim tensors summed on the device, no host transfer per micro-batch; every rank has
    # the same keys, even one with no active row
    names = [*loss.stat_names(with_sampling_logp=batch.rollout.sampling_logp is not None), "entropy"]
    totals = {key: batch.mask.new_zeros(()) for key in names}
    loss_total = 0.0
    grad_norm = 0.0
    skipped = 0
    policy.train()
    for _ in range(num_iterations):
        losses = []
        for rows in micro_batches(rows_run, batch.micro_batch_size):
            sub, index = batch.rollout.take(rows), torch.tensor(rows, device=batch.mask.device)
            # forward and backward bucket by bucket: the peak holds one bucket's activations, not the micro-batch's
            for bucket in buckets(policy, sub, with_entropy=True, grad=True, entropy_grad=entropy_grad,
                                  bucket_rows=batch.bucket_rows, decoder=decoder):
                picked = index[bucket.rows]  # [b] the bucket's rows in the batch
                mask = loss_mask[picked]
                old = batch.old_logp[picked] if batch.old_logp is not None else bucket.logp.detach()
                ref = batch.ref_logp[picked] if batch.ref_logp is not None else None
                # the sampler's own log-probs (vLLM): sampler/logp_gap and, with algo.is_correction_cap, IS weights
                sampling = None if sub.sampling_logp is None else sub.sampling_logp[bucket.rows]
                # the bucket's share of the batch loss (the loss is a sum over rows)
                bucket_loss, stats = loss_fn(bucket.logp, old, ref, batch.advantages[picked], mask,
                                             sampling_logp=sampling, entropy=bucket.entropy if loss_entropy else None)
                losses.append(bucket_loss.detach())
                share = mask.sum() / active_tokens / num_iterations  # this bucket's share of the tokens
                for key, value in {**stats, "entropy": masked_mean(bucket.entropy.detach(), mask)}.items():
                    totals[key] = totals[key] + value.detach() * share
                bucket_loss.backward()
        pass_loss = torch.stack(losses).sum() if losses else batch.mask.new_zeros(())
        # the batch gradient: this rank's micro-batch losses are its share of the batch loss (a sharded weight's
        # gradient was summed by FSDP's reduce-scatter in the backwards: sum_gradients leaves it)
        world.sum_gradients(params)
        pass_loss = float(world.sum(pass_loss))  # one transfer per optimizer step
        loss_total += pass_loss / num_iterations
        # the global norm: of a sharded policy's gradients over every rank's shards (clip_grad_norm_ on DTensors)
        grad_norm = float(whole_tensor(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)))
        if math.isfinite(grad_norm) and math.isfinite(pass_loss) and step_or_undo(optimizer, params, world):
            scheduler.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=False)
    # the token statistics: this rank's token-weighted share, summed over ranks (one transfer); 0 when no
    # token was updated
    values = world.sum(torch.stack([totals[k].float() for k in totals])).tolist()
    counts = world.sum(torch.tensor([len(batch.active)]))
    return UpdateStats(loss=loss_total, tokens=dict(zip(totals, values)), grad_norm=grad_norm,
                       nonfinite_skipped=skipped, backward_seqs=int(counts[0]) * num_iterations,
                       ref_forward_seqs=batch.num_sequences if batch.ref_logp is not None else 0)
