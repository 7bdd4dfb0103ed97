"""`trainer.fsdp=true`: the frozen base model sharded across the ranks with FSDP2 (`fully_shard`); with
model.finetune=full, every weight with its gradient and optimizer state.

    torchrun --nproc-per-node 2 $(which grpo) train trainer.fsdp=true ...
    torchrun --nproc-per-node 2 $(which grpo) train trainer.fsdp=true model.finetune=full optimizer.lr=1e-6

What is sharded and what is not, and why (a LoRA run):
- the base weights (embeddings, decoder layers, final norm, LM head): `fully_shard` on every decoder
  layer and on the causal LM around them (the root: embeddings, norm and the tied head), so each rank
  holds 1/N of them at rest and gathers one layer at a time in the update's forwards and backwards;
- the LoRA weights stay whole on every rank (`ignored_params`), and so do their gradients and the
  optimizer state: they are a few MB, the data-parallel design of grpo_cli.distributed stays as it
  is (rows with zero advantage skipped, gradients summed with one all_reduce per optimizer step,
  rank 0 writes the adapter from its own weights with no gather, resume across world sizes unchanged).
  Sharding them too would make FSDP reduce-scatter their gradients inside every backward.

A full-parameter run (model.finetune=full), where sharding pays (16-20 bytes a trained weight, docs/multi-device.md):
- every weight is sharded, none ignored: the weights, their gradients and AdamW's moments are DTensors, 1/N of
  each on every rank; the frozen reference copy (β > 0) is sharded the same way;
- the gradients are summed by FSDP's reduce-scatter in each backward (a sum, not FSDP's default mean: the loss is
  weighted by the whole batch's counts, as grpo_cli.distributed's all_reduce, which leaves DTensors out, expects);
  the lockstep below makes every rank run the same backwards, so the reduce-scatters pair up. clip_grad_norm_ on
  DTensors takes the global norm; update.step_or_undo undoes a step on every rank when one rank's shard went
  non-finite;
- a checkpoint is gathered whole to rank 0 (`gather_state`: every rank joins, rank 0 keeps each tensor on the host)
  and written as one process writes it; a resume reads the whole state on every rank and keeps its shard (`like`,
  `shard_optimizer_state`), so runs resume across world sizes, with or without FSDP.

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
- the in-process sampler=vllm is refused (commands/train.py check_world): every rank's engine push reads whole
  weights from its policy. sampler=vllm_server samples: rank 0 writes a LoRA adapter from its own whole copy, and a
  full-parameter policy's weights are gathered for the push a layer at a time (`whole_parts`, every rank joining;
  rank 0 writes each layer's file); whether they changed since the last push is one all_reduce (`weights_stamp`).
  Gradient checkpointing works (its whole-sequence path: one root forward per micro-batch).
  One process: nothing to shard, a no-op, so a run resumes on any number of ranks with or without it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from grpo_cli.distributed import World
from grpo_cli.policy import trains_adapter


def shard(policy, world: World, frozen=None) -> str:
    """Shard `policy` over the ranks, in place: a LoRA policy's base (its LoRA weights left whole), or a full-parameter
    policy's every weight and `frozen`, its reference (policy.keep_reference); the line that says how much each rank
    holds."""
    if world.size == 1:
        return "fsdp: one process, nothing to shard (trainer.fsdp takes effect under torchrun)"
    mesh = init_device_mesh(world.device.split(":")[0], (world.size,))
    if not trains_adapter(policy):  # model.finetune=full: every weight, its gradient and AdamW state sharded
        _shard_model(policy, mesh, ignored=set())
        if frozen is not None:  # the reference: the same layout, frozen
            _shard_model(frozen, mesh, ignored=set())
        held, whole_bytes = resident_bytes(policy)
        reference = " (the frozen reference too)" if frozen is not None else ""
        return (f"fsdp: every weight, its gradient and optimizer state sharded over {world.size} ranks{reference}, "
                f"{held / 2**20:.3g} MB of {whole_bytes / 2**20:.3g} MB of weights per rank")
    base = policy.get_base_model()  # the causal LM (peft's wrapper stays outside: it holds no base weight)
    _shard_model(base, mesh, ignored={p for p in policy.parameters() if p.requires_grad}, outer=policy)
    held, whole_bytes = resident_bytes(policy)
    return (f"fsdp: base sharded over {world.size} ranks, {held / 2**20:.3g} MB of {whole_bytes / 2**20:.3g} MB "
            f"per rank")


def _shard_model(model, mesh, ignored: set, outer=None) -> None:
    """`fully_shard` every decoder layer of causal LM `model` and the model around them (the root: embeddings, final
    norm, the tied head), `ignored` left whole; the gradients of what trains are summed over the ranks, as
    grpo_cli.distributed sums them (the loss is already weighted by the whole batch's counts), not averaged."""
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    if not ignored:  # every weight sharded (model.finetune=full): FSDP reduces their gradients
        for m in _modules(model):
            m.set_gradient_divide_factor(1.0)  # a sum: FSDP averages by default
            m.set_force_sum_reduction_for_comms(True)  # SUM (gloo has no PREMUL_SUM); a factor of 1 divides by nothing
    # the root's weights stay gathered through a `root_gathered` block: logprobs reads the head's weight between
    # backwards, and FSDP would free it after each
    model.set_reshard_after_backward(False, recurse=False)
    # FSDP names its root in the first forward it sees; logprobs calls the decoder directly, so the first
    # forward is the root's: one token, no gradient
    device = next(model.parameters()).device
    with torch.no_grad():  # through `outer` (peft's wrapper) when there is one, as a run calls it
        (outer or model)(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()


def resident_bytes(policy) -> tuple[int, int]:
    """(bytes of the sharded weights this rank holds, bytes of them whole): a LoRA policy's base (its LoRA weights not
    counted), a full-parameter policy's every weight (its frozen reference not counted)."""
    full = not trains_adapter(policy)
    held = whole = 0
    for p in policy.parameters():
        if p.requires_grad and not full:
            continue
        size = p.element_size()
        whole += p.numel() * size
        held += local(p).numel() * size
    return held, whole


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: its shard when `t` is a DTensor (a sharded weight, its gradient or optimizer state),
    else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor gathered from every rank (a collective: every rank calls it, in the same order), else
    `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_parts(model, main: bool) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """Causal LM `model`'s weights whole, one part at a time, as (part number from 1, parts, {name: weight}): what
    precedes the decoder layers (the embeddings), each decoder layer, what follows (the final norm; the LM head
    when not tied), each parameter under its name (a tied weight once). On rank `main` a part's weights are on the
    host, elsewhere the part is empty. Every rank takes every part: each sharded weight is gathered from every rank
    (a collective, in the same order everywhere) and freed on the device at once, so no rank holds more than one
    weight gathered; rank `main` holds one part on the host. Not sharded: the weights as they are, on the host."""
    for m in _modules(model):  # local: every rank's weights sharded alike, whatever it held gathered (root_gathered)
        m.reshard()
    # a model without decoder layers to find (no get_decoder, or no .layers) goes as one part
    layers = getattr(model.get_decoder(), "layers", []) if hasattr(model, "get_decoder") else []
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    params = list(model.named_parameters())  # the same order on every rank
    parts = [list(group) for _, group in itertools.groupby(params, key=lambda item: layer_of.get(id(item[1])))]
    for number, part in enumerate(parts, 1):
        out = {}
        for name, p in part:
            gathered = whole_tensor(p.detach())  # [whole shape], on the device
            if main:
                out[name] = gathered.cpu().contiguous()
            del gathered
        yield number, len(parts), out


# a weight's bits read as integers of its element's width: their sum is exact in any order
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_stamp(model, world: World) -> tuple[int, ...]:
    """One number per weight of `model` that changes when the weight does, the same whether the weight is sharded
    (its shards' numbers summed over the ranks) or gathered whole on every rank (inside `whole`: counted on rank 0):
    the sum of its bits read as integers, exact in any order. One all_reduce: every rank calls it."""
    params = list(model.parameters())
    sums = torch.zeros(len(params), dtype=torch.int64, device=local(params[0]).device)  # [weights]
    for i, p in enumerate(params):
        part = local(p.detach()) if isinstance(p, DTensor) else p.detach() if world.main else None
        if part is not None:
            sums[i] = part.view(_BITS[part.element_size()]).sum(dtype=torch.int64)
    return tuple(world.sum(sums).tolist())


def like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`full`, a whole tensor every rank holds (read from a checkpoint), laid out as `param` is: this rank's shard
    when `param` is a DTensor (cut locally, no communication), else `full` itself."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def sharded_weights(params) -> bool:
    """Some of `params` are sharded (a full-parameter policy under trainer.fsdp): their gradients are FSDP's to
    reduce, and each rank holds only part of them."""
    return any(isinstance(p, DTensor) for p in params)


def gather_state(policy, optimizer, main: bool) -> tuple[dict, dict] | None:
    """A sharded full-parameter policy's weights (every parameter under its name, the tied head once) and
    `optimizer.state_dict()` with every tensor whole, on the host, as one process holds them: rank `main` gets
    them, the others None. Every rank must call it (each DTensor is gathered in turn, the same order everywhere);
    what `torch.distributed.checkpoint.state_dict`'s full_state_dict=True, cpu_offload=True does, keeping the
    optimizer's own numbering of its parameters, which the checkpoint's optimizer.json records."""
    keep = (lambda t: t.detach().cpu()) if main else (lambda t: None)
    weights = {name: keep(whole_tensor(p.detach())) for name, p in policy.named_parameters()}
    state = optimizer.state_dict()
    slots = {idx: {k: keep(whole_tensor(v)) if torch.is_tensor(v) else v for k, v in s.items()}
             for idx, s in state["state"].items()}
    return (weights, {"state": slots, "param_groups": state["param_groups"]}) if main else None


def shard_optimizer_state(optimizer, state: dict) -> dict:
    """`state` (an optimizer.state_dict() whose tensors are whole, read from a checkpoint) with each parameter's
    tensors of its shape laid out as the parameter is (`like`); its scalars (AdamW's step) as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict()'s numbering
    if not sharded_weights(params):
        return state
    out = {}
    for idx, slots in state["state"].items():
        p = params[int(idx)] if int(idx) < len(params) else None  # None: load_state_dict says it does not fit
        out[idx] = {k: like(v, p) if p is not None and torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in slots.items()}
    return {"state": out, "param_groups": state["param_groups"]}


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
