"""`trainer.fsdp=true`: the frozen base model sharded across the ranks with FSDP2 (`fully_shard`).

    torchrun --nproc-per-node 2 $(which grpo) train trainer.fsdp=true ...

What is sharded and what is not, and why:
- the base weights (embeddings, decoder layers, final norm, LM head): `fully_shard` on every decoder
  layer and on the causal LM around them (the root: embeddings, norm and the tied head), so each rank
  holds 1/N of them at rest and gathers one layer at a time in the update's forwards and backwards;
- the LoRA weights stay whole on every rank (`ignored_params`), and so do their gradients and the
  optimizer state: they are a few MB, the data-parallel design of grpo_cli.distributed stays as it
  is (rows with zero advantage skipped, gradients summed with one all_reduce per optimizer step,
  rank 0 writes the adapter from its own weights with no gather, resume across world sizes unchanged).
  Sharding them too would make FSDP reduce-scatter their gradients inside every backward.

Where it departs from the data-parallel run (the numbers are the same, the schedule is not):
- FSDP gathers each layer in its forward and again in its backward, a collective every rank must
  join in the same order. So every rank runs the same forwards and backwards: the rows that go
  through the update are padded with rows of the rank's own batch, masked out of the loss (`lockstep`),
  up to the busiest rank's count, so every rank has the same micro-batches and the same length buckets
  (logprobs runs the decoder once per bucket whatever its length). A rank with nothing to learn
  still computes, where data parallelism lets it skip;
- sampling (HF generate) calls the model once per new token and ranks stop at different lengths, so
  the rollout runs on the whole base (`whole`): every layer gathered at its start, freed at its end.
  Its peak holds the whole base on every rank, as without FSDP; the update's holds 1/N of the layers
  plus the root's weights (gathered for each `logprobs.buckets` call, `root_gathered`: it reads the
  LM head's weight and calls the decoder directly, outside the root's own forward);
- sampler=vllm is refused (commands/train.py check_world): its weight push reads whole weights from the
  policy. Gradient checkpointing works (its whole-sequence path: one root forward per micro-batch).
  One process: nothing to shard, a no-op, so a run resumes on any number of ranks with or without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from grpo_cli.distributed import World


def shard(policy, world: World) -> str:
    """Shard `policy`'s base over the ranks, in place (LoRA weights left whole); the line that says how much
    each rank holds: "fsdp: base sharded over N ranks, X MB of Y MB per rank"."""
    if world.size == 1:
        return "fsdp: one process, nothing to shard (trainer.fsdp takes effect under torchrun)"
    base = policy.get_base_model()  # the causal LM (peft's wrapper stays outside: it holds no base weight)
    lora = {p for p in policy.parameters() if p.requires_grad}
    mesh = init_device_mesh(world.device.split(":")[0], (world.size,))
    for layer in base.get_decoder().layers:
        fully_shard(layer, mesh=mesh, ignored_params=lora)
    fully_shard(base, mesh=mesh, ignored_params=lora)
    # the root's weights stay gathered through a `root_gathered` block: logprobs reads the head's weight between
    # backwards, and FSDP would free it after each
    base.set_reshard_after_backward(False, recurse=False)
    # FSDP names its root in the first forward it sees; logprobs calls the decoder directly, so the first
    # forward is the root's: one token, no gradient
    with torch.no_grad():
        policy(input_ids=torch.zeros(1, 1, dtype=torch.long, device=world.device))
    base.reshard()
    held, whole_bytes = resident_bytes(policy)
    return (f"fsdp: base sharded over {world.size} ranks, {held / 2**20:.3g} MB of {whole_bytes / 2**20:.3g} MB "
            f"per rank")


def resident_bytes(policy) -> tuple[int, int]:
    """(bytes of base weights this rank holds, bytes of the whole base): LoRA weights not counted."""
    held = whole = 0
    for p in policy.parameters():
        if p.requires_grad:
            continue
        size = p.element_size()
        whole += p.numel() * size
        held += (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) * size
    return held, whole


def _modules(policy) -> list[FSDPModule]:
    """The sharded modules, root first, in the same order on every rank (collectives pair up by order)."""
    return [m for m in policy.modules() if isinstance(m, FSDPModule)]


def sharded(model) -> bool:
    """The model's base is sharded (its forwards and backwards are collectives)."""
    return bool(_modules(model))


@contextlib.contextmanager
def root_gathered(model) -> Iterator[None]:
    """Context: the root's weights (embeddings, norm, LM head) gathered, for code that calls the decoder and reads
    the head's weight outside the root's forward (logprobs); freed at the end. Nothing when not sharded.

    Freed first, then gathered: whether a group is gathered is each rank's own state (rank 0 alone saves
    checkpoints, and `state_dict` frees every group), so every rank joins the one all-gather whatever it held.
    """
    modules = _modules(model)
    if not modules:
        yield
        return
    modules[0].reshard()  # local: no collective
    modules[0].unshard()
    try:
        yield
    finally:
        modules[0].reshard()


@contextlib.contextmanager
def whole(policy) -> Iterator[None]:
    """Context: every base weight gathered, none freed after a forward (generate's forwards are as many as
    the rank's longest completion, different on each rank); all freed at the end. Nothing when not sharded."""
    modules = _modules(policy)
    for m in modules:  # freed first, then gathered: every rank joins every all-gather (see root_gathered)
        m.set_reshard_after_forward(False, recurse=False)
        m.reshard()
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            if m is not modules[0]:  # the root keeps its weights after a forward anyway (FSDP's default)
                m.set_reshard_after_forward(True, recurse=False)


def lockstep(active: list[int], n: int, world: World) -> tuple[list[int], list[int]]:
    """(rows to run, the fillers among them): `active` padded with other rows of this rank's `n`, up to the most
    any rank runs, so every rank runs the same micro-batches (FSDP's gathers must pair up). The caller masks
    the fillers out of the loss."""
    most = int(world.max(torch.tensor([len(active)]))[0])
    if not active and not most:
        return [], []
    taken = set(active)
    spare = [i for i in range(n) if i not in taken] or list(range(n))  # all active: repeat rows
    fillers = [spare[i % len(spare)] for i in range(most - len(active))]
    return active + fillers, fillers
