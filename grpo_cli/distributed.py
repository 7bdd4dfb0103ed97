"""Data parallelism: N ranks, one process each, started by `torchrun` or `accelerate launch`.

    torchrun --nproc-per-node 2 $(which grpo) train ...            # gloo on CPU, NCCL on CUDA

How the work is split, and why this way (TRL shards through accelerate, verl through a central
controller, nanoGPT wraps the model in DDP; this follows none of them exactly):
- every rank draws the same global `trainer.prompts_per_step` prompts from the same seeded stream and
  keeps its own contiguous slice, so the stream's state is the same on every rank (resume needs one
  saved state) and each group of G completions lives on one rank: group normalization stays local;
- outcome rewards are gathered before the advantages are computed, so `advantage_scale=batch` sees the
  whole batch and the advantages are exactly the 1-rank ones;
- loss weights use the global sequence and token counts (`World.sum` of the local ones), so the
  local losses add up to the 1-rank batch loss and their gradients to its gradient;
- gradients are summed with one `all_reduce` of the flattened LoRA gradients per optimizer step, not
  with DDP: DDP reduces inside each backward, and ranks run different numbers of backwards here (rows
  whose advantage is 0 are skipped, so a rank can have none). A rank with no active row still joins
  the one reduction, so nothing waits forever. The adapter is a few MB: one reduction costs little
  (trainer.fsdp shards the frozen base on top of this and keeps it: grpo_cli.fsdp);
- the adapter starts from rank 0's weights (broadcast), each rank samples with its own seed, a
  function of (seed, step, rank);
- rank 0 alone writes (metrics reduced over ranks, completions of its own slice, checkpoints,
  plots); the run folder's time stamp is rank 0's (`start_time`), so every rank names the same folder.

A rank that dies (kill -9, a crash) breaks the others' next collective: each ends with one RunError
line naming the dead rank (found by the host and pid every rank gave at start), not the backend's
"Connection reset by peer" traceback; `grpo train` guards its whole work so, FSDP's gathers included.
Nothing written is half done: checkpoints are renamed into place whole, and a metrics line cut short is
dropped on resume.

A single process (no WORLD_SIZE in the environment, or 1) gets `SINGLE`, whose collectives return
their input: the code paths are the same, and the 1-rank numbers are unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from grpo_cli.errors import RunError

_START: datetime | None = None
# seconds a rank whose collective broke waits for the rank that broke it to be gone, before it says "another rank"
_GONE_WAIT_S = 3.0
_WORLD: World | None = None
# a lost rank broke _WORLD's group and this process tore it down (_leave_broken_world): no new group is joined
_BROKEN = False


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; collectives are no-ops for a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    # where collectives run: NCCL reduces CUDA tensors only, gloo CPU ones
    device: str = "cpu"
    # (host, pid) of every rank, in rank order: which one died, when a collective breaks
    peers: tuple[tuple[str, int], ...] = ()

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        return self._reduce(tensor, torch.distributed.ReduceOp.SUM) if self.size > 1 else tensor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Maximum over ranks, in place; returns `tensor`."""
        return self._reduce(tensor, torch.distributed.ReduceOp.MAX) if self.size > 1 else tensor

    def _reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        there = tensor.to(self.device)
        with self.lost_rank():
            torch.distributed.all_reduce(there, op=op)
        if there is not tensor:
            tensor.copy_(there)
        return tensor

    def cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each) concatenated along dim 0, in rank order."""
        if self.size == 1:
            return tensor
        there = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(there) for _ in range(self.size)]
        with self.lost_rank():
            torch.distributed.all_gather(parts, there)
        return torch.cat(parts).to(tensor.device)

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable Python data, made and read by this code), in rank order."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        with self.lost_rank():
            torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        with self.lost_rank():
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Each parameter's gradient <- its sum over ranks: one all_reduce of them all, flattened.

        A parameter with no gradient on this rank (no backward yet) counts as zeros, so every rank
        joins the same reduction whatever it ran. A sharded parameter (a DTensor: a full-parameter policy under
        trainer.fsdp) is left out: FSDP's reduce-scatter in the backward has summed its gradient already.
        """
        params = [p for p in params if not isinstance(p, DTensor)]
        if self.size == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numel]; LoRA weights: a few MB
        self._reduce(flat, torch.distributed.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n

    def copy_from_main(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values of `params` on every rank (the same adapter init everywhere)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for p in params:
                there = p.data.to(self.device)
                with self.lost_rank():
                    torch.distributed.broadcast(there, src=0)
                p.data.copy_(there)

    @contextlib.contextmanager
    def lost_rank(self, *, collective: bool = True) -> Iterator[None]:
        """A collective that breaks (gloo's "Connection reset by peer", NCCL's errors: RuntimeError kinds)
        ends in a RunError naming the rank that is gone. `collective=False` guards a block that runs collectives
        it does not call itself (a command's whole work: FSDP's gathers inside the model's forward and backward):
        there, only an error met while a rank is gone is converted; any other goes on as it was raised."""
        try:
            yield
        except (RuntimeError, ConnectionError, ValueError) as err:
            if isinstance(err, ValueError) and not _BROKEN:  # ValueError: a collective on a group torn down here
                raise
            dead = self._gone() if self.size > 1 else []
            if not dead and not collective:
                raise
            who = (f"rank {dead[0]} (pid {self.peers[dead[0]][1]})" if len(dead) == 1 else
                   f"ranks {', '.join(map(str, dead))}" if dead else "another rank")
            reason = " ".join(str(err).split())[:120] or type(err).__name__
            _leave_broken_world()
            raise RunError(f"{who} stopped (killed or crashed), so rank {self.rank} cannot go on ({reason}); every "
                           f"rank stops, the last checkpoint is whole: resume the run with grpo train resume=RUN"
                           ) from None

    def _gone(self) -> list[int]:
        """The ranks on this host whose process has ended, waiting up to _GONE_WAIT_S for one: a rank's
        connections close before its process ends (a crash's traceback and exit, a kill the launcher has yet to
        reap), so the collective can break while the rank that broke it still looks alive."""
        here = socket.gethostname()
        local = [r for r, (host, _) in enumerate(self.peers) if r != self.rank and host == here]
        deadline = time.monotonic() + _GONE_WAIT_S
        while local:
            dead = [r for r in local if not _alive(self.peers[r][1])]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)
        return []

    def slice(self, n: int) -> slice:
        """This rank's contiguous share of `n` items (n divisible by the world size)."""
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


SINGLE = World()


def _alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped by its launcher, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def world_size() -> int:
    """The number of ranks the launcher asked for (WORLD_SIZE), 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_world() -> World:
    """Join the process group the launcher set up (NCCL on CUDA, one device per LOCAL_RANK; gloo on
    CPU); `SINGLE` without a launcher. Safe to call more than once."""
    global _WORLD
    if world_size() == 1:
        return SINGLE
    if _WORLD is not None and (dist.is_initialized() or _BROKEN):
        return _WORLD

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    device = f"cuda:{local_rank}" if dist.get_backend() == "nccl" else "cpu"
    world = World(dist.get_rank(), dist.get_world_size(), local_rank, device)
    peers = tuple(world.gather((socket.gethostname(), os.getpid())))  # once: which rank is which process
    _WORLD = World(world.rank, world.size, local_rank, device, peers)
    return _WORLD


def close_world() -> None:
    """Leave the process group at a command's normal end (nothing without one). Left to the interpreter's exit,
    gloo's worker threads can outlive it and abort the process ("terminate called without an active exception",
    SIGABRT) after the command's work is done: a rank of a finished run exiting non-zero. Not on an error: a rank
    that fails while others are inside a collective must not wait for them here."""
    global _WORLD, _START, _BROKEN
    # only the group init_world joined (_WORLD; a 1-process run's in-process vLLM engine makes its own group), and
    # not while vLLM's groups live on it: the engine's shutdown at exit destroys them and the group itself
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    vllm_groups = parallel_state is not None and parallel_state.model_parallel_is_initialized()
    if _WORLD is not None and dist.is_initialized() and not vllm_groups:
        destroy_groups()
    _WORLD, _START, _BROKEN = None, None, False


def _leave_broken_world() -> None:
    """Tear down a group a lost rank broke. No collective can run on it again, and left to the interpreter's exit
    its gloo threads abort the process (SIGABRT, "terminate called without an active exception") after the
    error line: a failed rank would end killed by a signal instead of with its exit code. Destroying a gloo group
    talks to no peer, so it cannot wait on the dead one. `_WORLD` stays: the broken world is still this process's
    world (init_world must not join a new group), and a collective on it fails as any broken one does."""
    global _BROKEN
    _BROKEN = True
    if dist.is_initialized() and dist.get_backend() == "gloo":  # NCCL's teardown may wait on the lost peer
        with contextlib.suppress(RuntimeError, ValueError):
            destroy_groups()


def destroy_groups() -> None:
    """Destroy this process's groups and end their threads now. destroy_process_group alone leaves a group's
    threads (gloo's loops, rank 0's store) running while anything still holds the group, and FSDP holds it past the
    run twice: its device mesh (DTensor's caches keep the mesh) and each sharded module's mesh info (the group
    itself, kept as long as the module lives, which can be past its last use). Threads still running at the
    interpreter's exit can abort it ("terminate called without an active exception") after the work is done."""
    dist.destroy_process_group()
    mesh = sys.modules.get("torch.distributed.device_mesh")
    if mesh is None:  # FSDP never ran here: nothing else holds the group
        return
    fsdp_common = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_common")
    mesh_info = getattr(fsdp_common, "DataParallelMeshInfo", ())
    for obj in gc.get_objects():
        if type(obj) is mesh.DeviceMesh:
            getattr(obj, "_pg_registry", {}).clear()
        elif issubclass(type(obj), mesh_info):  # its shard_, reduce_scatter_ and replicate_process_group
            for key, value in list(vars(obj).items()):
                if isinstance(value, dist.ProcessGroup):
                    setattr(obj, key, None)
    gc.collect()  # the groups' last holders go now, and with them their threads


def start_time() -> datetime:
    """When this run started: rank 0's clock on every rank (run folders are named from it)."""
    global _START
    if _START is None:
        now = datetime.now()
        _START = init_world().broadcast(now) if world_size() > 1 else now
    return _START
