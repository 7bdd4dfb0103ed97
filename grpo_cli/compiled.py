"""The update's decoder under `torch.compile` (inductor): `trainer.compile`.

    decoder = for_update(policy, cfg, say=console.print)      # a CompiledDecoder, or None: eager
    for bucket in logprobs.buckets(policy, rollout, grad=True, decoder=decoder): ...
    line = decoder.report()                                     # "compiled the update in 41 s", once

What is compiled: the policy's decoder layers with their LoRA projections, the forward and, through AOTAutograd,
its backward, so each layer's RMSNorms, rotary, SiLU·up, LoRA's scalings and residual adds run as a few fused
loops instead of one kernel each. Only the update's forward with a gradient goes through it (the reference and
old-policy forwards, eval and sample stay eager: they are a fraction of the time and would each compile graphs of
their own); the fused LM head and log-softmax after the hidden states (`kernels.head_logprobs`) stays eager, it is
already one pass per chunk.

Granularity: regional, the layer body compiled once for all layers (`regional`: Llama's layers, SmolLM2's and the
tiny model's). A layer writes its keys and values to the KV cache at its own `layer_idx`, a constant dynamo would
guard on (a recompile per layer), so a layer runs as two compiled regions around an eager middle: before the
attention (the input norm, q/k/v with their LoRA, rotary) and after it (o_proj, both residual adds, the
post-attention norm, the MLP with its LoRA); the cache write and the attention itself (one SDPA call) stay eager.
The regions take the layer as an argument: dynamo lifts its weights to graph inputs and guards on its structure,
not its identity, so the 30 layers of SmolLM2 run the same two graphs, and the prompt pass and the buckets share
them too (the cache is outside). The compile costs what one layer does, whatever the depth; the whole decoder as
one graph (the mode for other architectures, whose layers this module does not rewrite) compiled SmolLM2's 30
layers unrolled, 433 s on 2 quiet cores (docs/speed.md). While the compiled decoder runs, each layer's `forward`
is an instance attribute pointing at `CompiledDecoder._layer`; the class's comes back when the call returns.

Shapes: dynamic, not padded to fixed buckets. Every call's sizes vary: the distinct prompts and their padded width
(the prompt pass), the bucket's rows, its longest completion and the prompt width of its cache (each bucket), so
padding each to a fixed set would pay for padded rows and tokens in every step. Compiled with `dynamic=True`, each
call's sizes are symbols of one graph; dynamo still specializes a size of 1 (a one-row bucket, a bucket of
one-token completions), and the first layer's input needs no gradient, so a run compiles at most REGION_GRAPHS
graphs (SHAPE_CLASSES for the whole decoder), whatever its lengths and depth.

The compile is paid at the first calls (its seconds read from dynamo's own timers; the backward is compiled with
the forward, so a failure shows at the call), and any exception there falls back to eager for the rest of the
run, said in one line: a region that fails runs as the plain function it compiles, so the layers already run in
that call keep their results and the cache its writes; the whole decoder reruns eager. Where it is not tried
(`why_eager`): gradient checkpointing (logprobs takes its whole-sequence path), FSDP over ranks (FSDP2's per-layer
gathers inside a compiled graph are not tried here), and under `auto` the tiny test model (its update is too small
to pay back a compile) and a 4-bit base (bitsandbytes' layers; `true` tries them). LoRA dropout > 0 draws its masks
from inductor's generator, seeded from torch's: a compiled run resumes exactly, but its masks differ from an eager
run's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch._dynamo.utils import calculate_time_spent, counters
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from grpo_cli.checks import Check, Rule

# the graphs one run compiles at most. Regional: two regions, each for the first layer (its input needs no gradient)
# and the others, each with a size of 1 among rows, tokens, both or neither (dynamo's 0/1 specialization): 2 x 2 x 4
REGION_GRAPHS = 16
# the whole decoder: the prompt pass and the bucket pass, each with and without a size of 1 among rows and tokens
SHAPE_CLASSES = 6

# the compiler (a test swaps in one that fails)
BACKEND = "inductor"


def _before_attention(layer, hidden, cos, sin):
    """A Llama layer up to its attention: [b, s, D] -> query, key, value [b, heads, s, d], rotated (the input norm, the
    q/k/v projections with their LoRA, rotary: one region, fused)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _after_attention(layer, residual, attended):
    """A Llama layer after its attention: [b, s, heads * d] -> [b, s, D] (the output projection, both residual adds,
    the post-attention norm and the MLP's gate, SiLU·up and down with their LoRA: one region, fused)."""
    h = residual + layer.self_attn.o_proj(attended)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def regional(decoder) -> bool:
    """Whether the decoder's layers are Llama's own (`LlamaDecoderLayer` and `LlamaAttention` forwards, whatever
    their norms and MLP): the layer body is then compiled once for all of them; otherwise the whole decoder."""
    layers = getattr(decoder, "layers", None)
    return bool(layers) and all(
        type(layer).forward is LlamaDecoderLayer.forward and type(layer.self_attn).forward is LlamaAttention.forward
        and "forward" not in vars(layer) for layer in layers)


class CompiledDecoder:
    """The policy's decoder, compiled on first use, called in place of it with the same keyword arguments; the eager
    decoder for good once compiling fails, or outside autograd (a no-gradient forward is not the update's).

    Regional (Llama layers, `regional`): while it runs, each layer's forward is `_layer`, which runs the two compiled
    regions around an eager attention and KV-cache write; the layers' own forwards come back when it returns."""

    def __init__(self, decoder, say: Callable[[str], object]):
        self.decoder = decoder
        self.regional = regional(decoder)
        if self.regional:
            self.regions = {fn: torch.compile(fn, backend=BACKEND, dynamic=True)
                            for fn in (_before_attention, _after_attention)}
        else:
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
                if self.regional:
                    return self._regional(inputs)
                return self.compiled(**inputs)
        except Exception as err:  # the whole decoder's compile (a region's failure is caught in _region)
            self._fail(err)
            return self.decoder(**inputs)
        finally:
            self.compile_seconds += calculate_time_spent()["total_wall_time"] - before

    def _regional(self, inputs):
        layers = self.decoder.layers
        try:
            for layer in layers:  # an instance attribute, shadowing the class's forward (regional() checked none)
                layer.forward = functools.partial(self._layer, layer)
            # a region's graphs (REGION_GRAPHS / 2) would meet dynamo's limit of 8 per function
            with torch._dynamo.config.patch(recompile_limit=REGION_GRAPHS):
                return self.decoder(**inputs)
        finally:
            for layer in layers:
                del layer.forward

    def _region(self, fn, *args):
        """`fn` compiled, or itself once a compile failed: the layers already run keep their compiled results
        (the same function within float rounding), so the call goes on without undoing the cache's writes."""
        if not self.failed:
            try:
                return self.regions[fn](*args)
            except Exception as err:
                self._fail(err)
        return fn(*args)

    def _layer(self, layer, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
               use_cache=False, position_embeddings=None, **kwargs):
        """`LlamaDecoderLayer.forward` (with its `LlamaAttention`) as two compiled regions around the attention."""
        attn = layer.self_attn
        q, k, v = self._region(_before_attention, layer, hidden_states, *position_embeddings)
        if past_key_values is not None:
            # the cache write at the layer's own index stays out of the regions: one graph serves every layer
            k, v = past_key_values.update(k, v, attn.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
        out, _ = attend(attn, q, k, v, attention_mask, dropout=attn.attention_dropout if attn.training else 0.0,
                        scaling=attn.scaling, **kwargs)  # [b, s, heads, d]
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()  # [b, s, heads * d]
        return self._region(_after_attention, layer, hidden_states, out)

    def _fail(self, err: Exception) -> None:
        self.failed = True
        # dynamo wraps the compiler's own error (BackendCompilerFailed): name that one
        err = getattr(err, "inner_exception", None) or err
        first = (str(err).strip().splitlines() or [""])[0][:160]
        self.say(f"compiling the update failed ({type(err).__name__}: {first}); it runs eager from here "
                 f"(trainer.compile=false skips the attempt)")

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
    if setting == "auto" and model.quantization:
        return "a 4-bit base's bitsandbytes layers are not compiled under auto (trainer.compile=true tries them)"
    return None


def for_update(policy, cfg, say: Callable[[str], object]) -> CompiledDecoder | None:
    """The compiled decoder the update runs (`trainer.compile`), or None: eager, said in one line unless the setting
    is false."""
    setting = cfg.trainer.compile
    if setting is False:
        return None
    if setting == "auto" and next(policy.parameters()).device.type == "cpu":
        # auto on a CPU: eager, silently. There the compiled update is 0.85-0.97x eager's (SmolLM2, 2 cores) for a
        # 36-69 s cold compile, so the default job's first run would be slower (docs/speed.md, Measured on a CPU);
        # trainer.compile=true compiles it anyway
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
