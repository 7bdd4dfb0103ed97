"""grpo_cli.compiled: the update's decoder under torch.compile gives eager's loss, log-probs and LoRA gradients, the
layer body regionally (once for every layer) or the whole decoder, does not recompile as lengths or depth change,
falls back to eager in one line when compiling fails (at the first graph or partway through the layers), and
trainer.compile is checked before the model loads."""

from __future__ import annotations

import pytest
import torch

from grpo_cli import compiled, logprobs, update
from grpo_cli.algo import build_loss
from grpo_cli.config import validate
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.policy import build_policy
from grpo_cli.rollout import Rollout
from tests.helpers.runs import tiny_cfg


def _rollout(seed: int, prompt: int, width: int) -> Rollout:
    """2 prompts x 4 completions of random lengths 2..width (left-padded prompts of `prompt` tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 60, (2, prompt), generator=g).repeat_interleave(4, 0)  # [8, P]
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[::2, 0] = 0  # every other row one token shorter, left-padded
    lengths = torch.randint(2, width + 1, (8,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()  # [8, T]
    return Rollout(prompt_ids, prompt_mask, torch.randint(3, 60, (8, width), generator=g) * mask, mask, [""] * 8,
                   [False] * 8)


def _policy(*overrides: str):
    cfg = tiny_cfg(*overrides)
    torch.manual_seed(0)
    policy, _, _ = build_policy(cfg.model)
    for p in policy.parameters():  # LoRA B starts at 0: give it weights, so its gradient path is not trivial
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return cfg, policy


def _step(policy, rollout: Rollout, decoder) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(loss, [N, T] log-probs, LoRA gradients) of one forward and backward, buckets of 3 rows (3 + 3 + 2)."""
    policy.zero_grad(set_to_none=True)
    total, logp = 0.0, torch.zeros(rollout.completion_ids.shape)
    for bucket in logprobs.buckets(policy, rollout, with_entropy=True, grad=True, bucket_rows=3, decoder=decoder):
        loss = (bucket.logp * torch.linspace(-1, 1, bucket.logp.shape[1])).sum() + 0.1 * bucket.entropy.sum()
        loss.backward()
        total += loss.detach()
        logp[bucket.rows] = bucket.logp.detach()
    return total, logp, [p.grad.clone() for p in policy.parameters() if p.requires_grad]


def test_a_bad_trainer_compile_is_one_line_naming_the_fix():
    from grpo_cli.commands.train import CHECKS

    with pytest.raises(ConfigError, match=r"trainer.compile \('sometimes'\).*set trainer.compile=auto"):
        validate(tiny_cfg("trainer.compile=sometimes"), *CHECKS)


def test_auto_on_a_cpu_is_eager_and_silent_and_names_why_for_the_tiny_model():
    cfg, policy = _policy()
    lines = []
    # auto on a CPU: eager without a word (the default run's console stays ours alone)
    assert compiled.for_update(policy, cfg, say=lines.append) is None
    assert compiled.for_update(policy, tiny_cfg("trainer.compile=false"), say=lines.append) is None
    assert lines == []
    # where auto would compile (a GPU), the tiny model still stays eager, and the reason names the way to force it
    reason = compiled.why_eager(cfg, "auto")
    assert reason and "trainer.compile=true" in reason


def _eager_and_fallen(monkeypatch, backend, seed: int, *overrides: str):
    """One step eager and one through `trainer.compile=true` with `backend` as the compiler, on the same rollout:
    (cfg, policy, rollout, decoder, the lines it said, eager step, compiled-or-fallen step)."""
    cfg, policy = _policy("trainer.compile=true", *overrides)
    monkeypatch.setattr(compiled, "BACKEND", backend)
    lines = []
    decoder = compiled.for_update(policy, cfg, say=lines.append)
    rollout = _rollout(seed, 6, 10)
    return cfg, policy, rollout, decoder, lines, _step(policy, rollout, None), _step(policy, rollout, decoder)


def test_a_failing_compile_falls_back_to_eager_in_one_line(monkeypatch):
    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here\nsecond line")

    cfg, policy, rollout, decoder, lines, eager, fallen = _eager_and_fallen(monkeypatch, broken, 0)
    assert len(lines) == 1 and "no compiler here" in lines[0] and "eager" in lines[0] and "\n" not in lines[0]
    # the fallback runs the eager decoder itself: the same numbers, bit for bit
    assert torch.equal(eager[0], fallen[0]) and torch.equal(eager[1], fallen[1])
    assert all(torch.equal(a, b) for a, b in zip(eager[2], fallen[2]))
    # and the update keeps running on it
    loss = build_loss(cfg.algo)
    batch = update.prepare(policy, rollout, torch.linspace(-1, 1, 8), loss, 1, 8, False)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build(cfg.optimizer)(params=params)
    stats = update.update(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), batch,
                          decoder=decoder)
    assert stats.nonfinite_skipped == 0 and len(lines) == 1


@pytest.fixture(scope="module")
def compiled_policy():
    """(policy, its compiled decoder, the lines it said), dropout 0: compiled once for the tests below."""
    cfg, policy = _policy("trainer.compile=true", "model.lora.dropout=0.0")
    lines = []
    return policy, compiled.for_update(policy, cfg, say=lines.append), lines


@pytest.mark.slow
@pytest.mark.ci
def test_the_compiled_step_matches_eager_within_float_tolerance(compiled_policy):
    policy, decoder, lines = compiled_policy
    rollout = _rollout(1, 7, 12)
    eager = _step(policy, rollout, None)
    fused = _step(policy, rollout, decoder)
    assert decoder.compile_seconds > 0 and not decoder.failed
    assert lines == [] and decoder.report().startswith("compiled the update in ")
    # fp32 both ways; inductor fuses RMSNorm, rotary, SiLU·up and LoRA's scaling into loops that sum in another
    # order (a vectorized reduction over D in lanes of 8 or 16, then across lanes), so each value moves by a few ulp
    # per layer: ~1e-7 relative here, far below what a wrong graph (a dropped scaling, a shifted position) moves
    # them (1e-2 or more)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused[1], eager[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(fused[2], eager[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.ci
def test_new_lengths_do_not_recompile(compiled_policy):
    policy, decoder, _ = compiled_policy
    _step(policy, _rollout(2, 6, 10), decoder)  # the shapes' classes compiled (dynamic sizes, see compiled.py)
    graphs = decoder.graphs()
    for seed, prompt, width in ((3, 9, 14), (4, 5, 7), (5, 11, 19)):  # other prompt widths, lengths and buckets
        _step(policy, _rollout(seed, prompt, width), decoder)
    assert decoder.graphs() == graphs
    assert decoder.regional and graphs <= compiled.REGION_GRAPHS


@pytest.mark.slow
@pytest.mark.ci
def test_a_deeper_model_compiles_no_new_graph(compiled_policy):
    policy, decoder, _ = compiled_policy
    rollout = _rollout(6, 8, 11)
    _step(policy, rollout, decoder)  # the 2-layer model's graphs for these shapes
    # 5 layers of the same structure, other weights: its layers run the graphs the 2 layers compiled (a compile per
    # layer would add graphs here, and past 8 per region fail over to eager)
    cfg, deeper = _policy("trainer.compile=true", "model.lora.dropout=0.0", "model.loader.num_layers=5")
    lines = []
    again = compiled.for_update(deeper, cfg, say=lines.append)
    eager = _step(deeper, rollout, None)
    fused = _step(deeper, rollout, again)
    assert again.graphs() == 0 and not again.failed and lines == []
    torch.testing.assert_close(fused[1], eager[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(fused[2], eager[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_compile_failing_partway_through_the_layers_gives_eager_numbers(monkeypatch):
    compiles = []

    def second_fails(graph, example_inputs):  # the first graph runs as traced (no inductor), the second fails
        compiles.append(graph)
        if len(compiles) > 1:
            raise RuntimeError("the second graph fails")
        return graph.forward

    # its own graphs (another width): none cached from the other tests
    _, _, _, decoder, lines, eager, fallen = _eager_and_fallen(monkeypatch, second_fails, 7,
                                                                "model.loader.hidden_size=24")
    # the first layer's first region ran compiled, the rest of the call eager, each layer's keys and values written
    # to the prompts' cache once (a rerun of the layers already run would append them twice: other log-probs)
    assert len(compiles) == 2 and decoder.failed and len(lines) == 1 and "the second graph fails" in lines[0]
    torch.testing.assert_close(fallen[0], eager[0])
    torch.testing.assert_close(fallen[1], eager[1])
    for a, b in zip(fallen[2], eager[2]):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_the_whole_decoder_compiled_matches_eager(monkeypatch):
    # the mode for layers compiled.regional does not rewrite (other architectures): one graph of every layer
    monkeypatch.setattr(compiled, "regional", lambda decoder: False)
    cfg, policy = _policy("trainer.compile=true", "model.lora.dropout=0.0")
    lines = []
    decoder = compiled.for_update(policy, cfg, say=lines.append)
    rollout = _rollout(1, 7, 12)
    eager = _step(policy, rollout, None)
    fused = _step(policy, rollout, decoder)
    assert not decoder.regional and not decoder.failed and lines == []
    assert 0 < decoder.graphs() <= compiled.SHAPE_CLASSES
    torch.testing.assert_close(fused[1], eager[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(fused[2], eager[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_resume_may_turn_the_compile_off():
    from grpo_cli.runs import resume_config

    saved = tiny_cfg()  # the run as it was saved: trainer.compile=auto
    assert resume_config(tiny_cfg("trainer.compile=false"), saved, ["trainer.compile=false"]).trainer.compile is False
