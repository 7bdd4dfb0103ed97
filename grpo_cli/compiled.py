"""The update's decoder under `torch.compile` (inductor): `trainer.compile`.

    decoder = for_update(policy, cfg, say=console.print)      # a CompiledDecoder, or None: eager
    for bucket in logprobs.buckets(policy, rollout, grad=True, decoder=decoder): ...
    line = decoder.report()                                     # "compiled the update in 41 s", once

What is compiled: the policy's decoder (embeddings, every layer with its LoRA projections, the final norm), the
forward and, through AOTAutograd, its backward, so each layer's RMSNorms, rotary, SiLU·up, LoRA's scalings and
residual adds run as a few fused loops instead of one kernel each. Only the update's forward with a gradient goes
through it (the reference and old-policy forwards, eval and sample stay eager: they are a fraction of the time and
would each compile graphs of their own); the fused LM head and log-softmax after the hidden states
(`kernels.head_logprobs`) stays eager, it is already one pass per chunk.

Granularity: the whole decoder as one graph, not one graph per layer. A layer writes its keys and values to the KV
cache at its own `layer_idx`, a constant dynamo guards on, so a compiled layer is recompiled for each layer index
(and for layer 0, whose input needs no gradient), past dynamo's recompile limit of 8; the whole decoder traces
each layer once into one graph, whose compile time grows with the number of layers.

Shapes: dynamic, not padded to fixed buckets. Every call's sizes vary: the distinct prompts and their padded width
(the prompt pass), the bucket's rows, its longest completion and the prompt width of its cache (each bucket), so
padding each to a fixed set would pay for padded rows and tokens in every step. Compiled with `dynamic=True`, each
call's sizes are symbols of one graph; dynamo still specializes a size of 1 (a one-row bucket, a bucket of
one-token completions), so a run compiles at most SHAPE_CLASSES graphs, whatever its lengths.

The compile is paid at the first calls (its seconds read from dynamo's own timers; the backward is compiled with
the forward, so a failure shows at the call), and any exception there falls back to the eager decoder for the rest
of the run, said in one line. Where it is not tried (`why_eager`): gradient checkpointing (logprobs takes its
whole-sequence path), FSDP over ranks (FSDP2's per-layer gathers inside a compiled graph are not tried here), and
under `auto` the tiny test model (its update is too small to pay back a compile) and a 4-bit base
(bitsandbytes' layers; `true` tries them). LoRA dropout > 0 draws its masks from inductor's generator, seeded from
torch's: a compiled run resumes exactly, but its masks differ from an eager run's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._dynamo.utils import calculate_time_spent, counters

from grpo_cli.checks import Check, Rule

# the graphs one run compiles at most: the prompt pass and the bucket pass, each with and without a size of 1 among
# rows and tokens (dynamo's 0/1 specialization)
SHAPE_CLASSES = 6

# the compiler (a test swaps in one that fails)
BACKEND = "inductor"


class CompiledDecoder:
    """The policy's decoder, compiled on first use, called in place of it with the same keyword arguments; the eager
    decoder for good once compiling fails, or outside autograd (a no-gradient forward is not the update's)."""

    def __init__(self, decoder, say: Callable[[str], object]):
        self.decoder = decoder
        self.compiled = torch.compile(decoder, backend=BACKEND, dynamic=True)
        self.say = say
        self.failed = False
        self.compile_seconds = 0.0  # dynamo + inductor, forward and backward, all calls so far
        self._reported = 0.0
        self._graphs = counters["stats"]["unique_graphs"]

    def __call__(self, **inputs):
        if self.failed or not torch.is_grad_enabled():
            return self.decoder(**inputs)
        before = calculate_time_spent()["total_wall_time"]
        try:
            # the backward compiled now, not at the first backward: a failure shows here, before any gradient
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                return self.compiled(**inputs)
        except Exception as err:
            self.failed = True
            # dynamo wraps the compiler's own error (BackendCompilerFailed): name that one
            err = getattr(err, "inner_exception", None) or err
            first = (str(err).strip().splitlines() or [""])[0][:160]
            self.say(f"compiling the update failed ({type(err).__name__}: {first}); it runs eager from here "
                     f"(trainer.compile=false skips the attempt)")
            return self.decoder(**inputs)
        finally:
            self.compile_seconds += calculate_time_spent()["total_wall_time"] - before

    def graphs(self) -> int:
        """Graphs compiled since this decoder was made (process-wide count: one compiled decoder at a time)."""
        return counters["stats"]["unique_graphs"] - self._graphs

    def report(self) -> str | None:
        """The line for the compile seconds not reported yet: the first compile, or new shape classes later."""
        new = self.compile_seconds - self._reported
        if self.failed or new <= 0:
            return None
        self._reported = self.compile_seconds
        again = " again (new shapes)" if self._reported > new else ""
        return f"compiled the update{again} in {new:.0f} s"


def why_eager(cfg, setting) -> str | None:
    """Why the update runs eager under this config although trainer.compile is `setting` (auto or true); None: it
    compiles."""
    trainer, model = cfg.trainer, cfg.model
    if trainer.gradient_checkpointing:
        return "gradient checkpointing runs the whole-sequence forward, which is not compiled"
    if trainer.fsdp and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return "compiling a decoder sharded by FSDP is not tried"
    if setting == "auto" and model.loader.get("_target_") == "grpo_cli.policy.load_tiny_random":
        return "model=tiny's update is too small to pay back a compile (trainer.compile=true compiles it)"
    if setting == "auto" and model.get("quantization"):
        return "a 4-bit base's bitsandbytes layers are not compiled under auto (trainer.compile=true tries them)"
    return None


def for_update(policy, cfg, say: Callable[[str], object]) -> CompiledDecoder | None:
    """The compiled decoder the update runs (`trainer.compile`), or None: eager, said in one line unless the setting
    is false."""
    setting = cfg.trainer.compile
    if setting is False:
        return None
    if setting == "auto" and next(policy.parameters()).device.type == "cpu":
        # auto on a CPU: eager, silently. Inductor compiles SmolLM2's whole decoder in minutes on 2 cores, more than
        # a default run's updates could win back (docs/speed.md); trainer.compile=true compiles it anyway
        return None
    reason = why_eager(cfg, setting)
    if reason is not None:
        say(f"the update runs eager: {reason}")
        return None
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    return CompiledDecoder(base.get_decoder(), say)


CHECKS: list[Check] = [
    Rule("trainer.compile", lambda v: isinstance(v, bool) or v == "auto",
         "must be auto, true or false; set trainer.compile=auto"),
]
