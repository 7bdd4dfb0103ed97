"""scripts/packed_projections.py compares equal work: its packed projections give the one-by-one numbers."""

from __future__ import annotations

import torch

from tests.helpers.scripts import load_script

packed_projections = load_script("packed_projections")


def test_packed_and_one_by_one_give_the_same_outputs_and_gradients():
    p = packed_projections.weights(seed=1)
    x = torch.randn(6, packed_projections.HIDDEN, requires_grad=True)
    outs = {}
    for fn in (packed_projections.one_by_one, packed_projections.packed):
        ys = fn(x, p)
        # a different weight per output, so a swapped or misplaced B block would show in the gradients
        loss = sum((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() for y in ys)
        grads = torch.autograd.grad(loss, [x, *p["a"].values(), *p["b"].values()])
        outs[fn.__name__] = ([y.detach() for y in ys], grads)
    (y1, g1), (y2, g2) = outs["one_by_one"], outs["packed"]
    assert [y.shape[1] for y in y2] == [576, 192, 192, 1536, 1536]
    for a, b in zip(y1 + list(g1), y2 + list(g2)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # fp32 sums in another order
    # the low-rank part is not negligible here: the check would see a missing one
    assert p["b"]["v"].abs().sum() > 0 and (y1[2] - x.detach() @ p["w"]["v"].T).abs().max() > 1e-4
