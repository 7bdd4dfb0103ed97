"""peft's LoRA linear layers with a leaner forward: the same function, fewer passes over the activations.

peft computes a LoRA layer as `base(x) + lora_B(lora_A(dropout(x))) * scaling`: the scaling multiplies the
[rows, out] product, and the sum makes another [rows, out] tensor, in forward and again in backward. Here the
scaling multiplies the [rows, r] activation instead (B(s·A x) = s·B(A x)), and the low-rank product is added by
the matmul itself, into the base's output in place (`addmm_`, result += (s·A x) Bᵀ: the linear's backward does not
read its output, and an out-of-place `addmm` first copies its [rows, out] input): three passes over [rows, out]
less in forward and one in backward, per adapted layer (7 per decoder layer for SmolLM2's LoRA). The numbers are
peft's up to float rounding.

`lean(policy)` swaps the class of each plain peft `lora.Linear` (the base an `nn.Linear`) for `LeanLinear`, its
subclass with this forward; everything else peft does (disabled or merged adapters, several active adapters,
dropout, DoRA and other variants, mixed-batch adapter names, a base in another precision than the adapter)
goes through peft's own forward unchanged.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class LeanLinear(LoraLinear):
    """A peft LoRA `Linear` whose plain case runs `base(x).addmm_(s·A(dropout(x)), Bᵀ)`."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        names = [name for name in self.active_adapters if name in self.lora_A]
        # outside autocast the base's output has its weight's dtype: an adapter in another one takes peft's
        # promotion rules, as does a bias on B (checked before the base runs, so it runs once)
        mixed = not torch.is_autocast_enabled(x.device.type) and any(
            self.lora_B[name].weight.dtype != self.base_layer.weight.dtype for name in names)
        if (args or kwargs or self.disable_adapters or self.merged or self.lora_variant or mixed
                or any(self.lora_B[name].bias is not None for name in names)):
            return super().forward(x, *args, **kwargs)
        lead = x.shape[:-1]
        # [M, in]: 2-D, so that the in-place sum below acts on the base's own output; on a view of it autograd would
        # route the gradient through a copy of the whole output (CopySlices)
        x = x.reshape(-1, x.shape[-1])
        result = self.base_layer(x)  # [M, out]
        for name in names:
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            x = self._cast_input_dtype(x, lora_a.weight.dtype)  # as peft (off inside policy.autocast)
            low = lora_a(self.lora_dropout[name](x)) * self.scaling[name]  # [M, r]
            # [M, out] += [M, r] @ [r, out]: the sum made by the matmul. Autocast casts an out-of-place addmm's
            # operands to its dtype, not an in-place one's: the casts to the output's dtype (that dtype under
            # autocast, a no-op outside it) give the same operands
            result.addmm_(low.to(result.dtype), lora_b.weight.T.to(result.dtype))
        return result.view(*lead, result.shape[-1])


def lean(policy):
    """Give `policy`'s plain LoRA linear layers `LeanLinear`'s forward (in place); returns `policy`."""
    for module in policy.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear:
            module.__class__ = LeanLinear
    return policy
