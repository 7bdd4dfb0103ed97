"""The training loop on the tiny random model: weights move where they should, checkpoints reload
exactly, resume is exact, and skipped work (reference forward, zero-advantage backward) is skipped."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from grpo_cli import checkpoint, recipe, update
from grpo_cli.algo import build_loss, loss_settings
from grpo_cli.commands import train
from grpo_cli.config import compose
from grpo_cli.instantiate import build
from grpo_cli.policy import build_policy
from tests.helpers.runs import TINY, deterministic, metrics, tiny_cfg, tiny_run
from tests.helpers.tools import MULTIPLY_TOOL, TOOL_CALL, first_turn_calls


def test_two_steps_move_lora_only_and_checkpoint_reloads(tmp_path):
    cfg = tiny_cfg("trainer.max_steps=2", "trainer.save_every=1")
    base_before, _ = build_policy(cfg.model)[:2]
    base_state = {k: v.clone() for k, v in base_before.state_dict().items() if "lora" not in k}
    last = train.run(cfg, tmp_path)

    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    for key in ("reward", "reward_std", "rewards/digit/mean", "frac_reward_zero_std", "kl", "clip_ratio/low_mean",
                "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio", "loss", "grad_norm", "learning_rate",
                "time/rollout_s", "time/update_s", "time/step_s", "tokens_per_s", "peak_memory_mb"):
        assert key in metrics(tmp_path)[0], key
    first = metrics(tmp_path)[0]  # the step holds its rollout and its update, and a little more (rewards)
    assert first["time/rollout_s"] + first["time/update_s"] <= first["time/step_s"]
    assert last == tmp_path / "checkpoints" / "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert {p.suffix for p in last.iterdir()} <= {".safetensors", ".json", ".yaml"}

    # the adapter moved (LoRA B starts at zero), the base weights did not
    adapter = load_file(last / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    policy, tokenizer, _ = build_policy(cfg.model)
    for k, v in policy.state_dict().items():
        if "lora" not in k:
            assert torch.equal(v, base_state[k]), k

    # a reloaded checkpoint gives the logits of the trained policy, bit for bit
    checkpoint.load_adapter(policy, last)
    ids = torch.tensor([tokenizer("What is 2+3?").input_ids])
    reloaded = policy(input_ids=ids).logits
    trained, _, _ = build_policy(cfg.model)
    checkpoint.load_adapter(trained, tmp_path / "checkpoints" / "step_000001")
    assert not torch.equal(trained(input_ids=ids).logits, reloaded)  # step 1 differs from step 2 ...
    checkpoint.load_adapter(trained, last)
    assert torch.equal(trained(input_ids=ids).logits, reloaded)  # ... and step 2 is step 2


def test_resume_is_exact(four_step_run, tmp_path):
    straight, split = four_step_run, tmp_path / "split"  # the straight run: 4 steps of tiny_cfg, shared (conftest)
    train.run(tiny_cfg("trainer.max_steps=2", "trainer.save_every=2"), split)
    train.run(tiny_cfg("trainer.max_steps=4", "trainer.save_every=2", f"resume={split}"), split)

    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [deterministic(r) for r in a] == [deterministic(r) for r in b]
    wa = load_file(straight / "checkpoints/step_000004/adapter_model.safetensors")
    wb = load_file(split / "checkpoints/step_000004/adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


class Counter:
    """Counts sequences through the trainer's forward, split by whether autograd records them: `buckets` with
    grad=True (the update), `sequence_logprobs` (reference and old log-probs, no gradient)."""

    def __init__(self, monkeypatch):
        self.with_grad = self.no_grad = 0
        real_buckets, real_logprobs = update.buckets, update.sequence_logprobs

        def counting_buckets(model, rollout, **kw):
            n = rollout.completion_ids.shape[0]
            if kw.get("grad"):
                self.with_grad += n
            else:
                self.no_grad += n
            return real_buckets(model, rollout, **kw)

        def counting_logprobs(model, rollout, **kw):
            self.no_grad += rollout.completion_ids.shape[0]
            return real_logprobs(model, rollout, **kw)

        monkeypatch.setattr(update, "buckets", counting_buckets)
        monkeypatch.setattr(update, "sequence_logprobs", counting_logprobs)


def test_beta_zero_makes_no_reference_forward(tmp_path, monkeypatch):
    count = Counter(monkeypatch)
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0"), tmp_path / "b0")
    assert count.no_grad == 0  # μ = 1 and β = 0: no reference and no old-policy forward
    assert metrics(tmp_path / "b0")[0]["counts/ref_forward_seqs"] == 0

    count = Counter(monkeypatch)
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0.04"), tmp_path / "b1")
    assert count.no_grad == 8  # 2 prompts x G=4, once, adapter off
    assert metrics(tmp_path / "b1")[0]["counts/ref_forward_seqs"] == 8


def test_zero_advantage_groups_make_no_backward(tmp_path, monkeypatch):
    # accuracy on arithmetic is 0 for every random completion: every group has zero std
    count = Counter(monkeypatch)
    cfg = compose("train", [o for o in TINY if "digit" not in o] + ["trainer.max_steps=1", "algo.beta=0"])
    train.run(cfg, tmp_path)
    record = metrics(tmp_path)[0]
    assert record["frac_reward_zero_std"] == 1.0
    assert count.with_grad == 0 and record["counts/backward_seqs"] == 0


# #24's options: GSPO's sequence ratio (with μ = 2, so it is not 1), the entropy bonus with the top-entropy mask
# (its threshold the batch's), and both at once
OPTIONS = {"plain": [], "gspo": ["algo=gspo", "algo.num_iterations=2"],
           "entropy": ["algo.entropy_coef=0.05", "algo.top_entropy_quantile=0.4"],
           "gspo_entropy": ["algo=gspo", "algo.num_iterations=2", "algo.entropy_coef=0.05",
                            "algo.top_entropy_quantile=0.4"]}


# every loss type plain; each option with a per-sequence (grpo) and a per-token (dapo) aggregation
# (the single options in `make test-all`; both together in the fast suite)
ACCUMULATION = [(loss, "plain") for loss in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
    pytest.param(loss, option, marks=[pytest.mark.slow] if option != "gspo_entropy" else [])
    for option in OPTIONS if option != "plain" for loss in ("grpo", "dapo")]


@pytest.mark.parametrize("loss_type,options", ACCUMULATION)
def test_micro_batches_accumulate_to_the_full_batch_gradient(loss_type, options):
    """Gradients of one 8-row pass equal the sum over micro-batches of 3 (ragged split 3+3+2)."""
    cfg = tiny_cfg(*OPTIONS[options], f"algo.loss_type={loss_type}", "algo.beta=0.04")
    policy, tokenizer, _ = build_policy(cfg.model)
    with torch.no_grad():  # move LoRA B off zero so policy != reference
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    sampler = build(cfg.sampler)
    torch.manual_seed(0)
    rollout = sampler.generate(policy, tokenizer, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"] * 2, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.5, 0.0, 1.5])
    mu = cfg.algo.num_iterations
    start = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    grads, ratios = {}, {}
    for micro in (8, 3):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if n in start:
                    p.copy_(start[n])
        opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        captured = {}

        def capture(captured=captured):
            captured.update({n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad})

        opt.step = capture
        loss = build_loss(cfg.algo)
        batch = update.prepare(policy, rollout, advantages, loss, mu, micro, False)
        if mu > 1:  # the policy moves after sampling (as after a first update), so the ratio is not 1
            with torch.no_grad():
                g = torch.Generator().manual_seed(5)
                for n, p in policy.named_parameters():
                    if n in start:
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
        ratios[micro] = update.update(policy, opt, sched, batch).tokens["ratio_mean"]
        grads[micro] = captured
    for name in grads[8]:
        assert torch.allclose(grads[8][name], grads[3][name], atol=1e-6, rtol=1e-4), name
    if mu > 1:
        assert abs(ratios[8] - 1) > 1e-4 and ratios[8] == pytest.approx(ratios[3], rel=1e-5)


def test_gspo_and_the_entropy_options_train_end_to_end(tmp_path):
    """algo=gspo with μ = 2, and the entropy bonus with the top-entropy mask, through `grpo train`'s loop."""
    cfg = tiny_cfg("algo=gspo", "algo.num_iterations=2", "trainer.max_steps=2")
    loss = loss_settings(cfg.algo)
    assert loss.importance_sampling_level == "sequence"
    assert (loss.epsilon_low, loss.epsilon_high) == (3e-4, 4e-4)
    train.run(cfg, tmp_path / "gspo")
    # the second pass is off-policy: the sequence ratio moves, and GSPO's narrow range clips some sequences
    records = metrics(tmp_path / "gspo")
    assert all(math.isfinite(r["loss"]) for r in records) and records[-1]["grad_norm"] > 0
    assert any(r["clip_ratio/region_mean"] > 0 for r in records)

    train.run(tiny_cfg("algo.entropy_coef=0.01", "algo.top_entropy_quantile=0.5", "trainer.max_steps=2"),
              tmp_path / "entropy")
    # μ = 1: the update's entropies are the ones the batch threshold (its median) was taken from, so half of the
    # updated tokens keep the policy gradient, up to ties at the median
    for r in metrics(tmp_path / "entropy"):
        assert r["entropy_mask/kept_mean"] == pytest.approx(0.5, abs=0.05), r


def test_the_overlong_penalty_shapes_the_trained_reward(tmp_path):
    """algo.overlong_buffer through the loop: the penalty is logged and the reward is the raw scores' sum plus it."""
    train.run(tiny_cfg("algo.overlong_buffer=4", "trainer.max_steps=1", "trainer.log_completions_every=1",
                       "trainer.num_completions_to_print=0"), tmp_path)
    for line in (tmp_path / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        # max_new_tokens 8, buffer 4: 0 up to 4 tokens, then -(L - 4)/4
        assert row["rewards"]["overlong"] == -max(0, row["length"] - 4) / 4
        assert row["reward"] == pytest.approx(sum(row["rewards"].values()))
    assert metrics(tmp_path)[0]["rewards/overlong/mean"] < 0  # random text of the tiny model runs to the cap


def test_an_episodes_overlong_penalty_ramps_against_its_token_budget(tmp_path, monkeypatch):
    """env=tools: the ramp runs against env.max_episode_tokens, the budget that cuts an episode, not against
    sampler.max_new_tokens, which an episode does not read."""
    tools = tmp_path / "budget_tools.py"
    tools.write_text(MULTIPLY_TOOL + "\n\ndef zero(prompts, completions, **kwargs):\n"
                                     "    return [0.0] * len(completions)\n")
    first_turn_calls(monkeypatch)  # each episode's one turn: the scripted call and EOS (max_turns 1: not run)
    run = tiny_run(tmp_path / "run", *TINY[:-2], "sampler.max_new_tokens=32", "env=tools", "env.max_turns=1",
                   f"env.tools=[{tools}:multiply]", "env.max_episode_tokens=100", "reward=custom",
                   f"reward.funcs=[{tools}:zero]", "algo.overlong_buffer=30")
    record = recipe.step(run, 1)
    tokens = record.kept.rollout.completion_mask.sum(1).tolist()
    assert tokens == [len(TOOL_CALL) + 1] * 8  # the call's 74 characters (one token each) and EOS: 75
    # L_max 100, buffer 30: free up to 70 tokens, then -1/30 a token: 75 -> -(75 - 70) / 30 = -0.167
    # (against sampler.max_new_tokens 32 it was -1: past the cap of a budget the episode never had)
    assert record.kept.result.per_function["overlong"] == pytest.approx([-(75 - 70) / 30] * 8)


def test_process_rewards_give_per_token_advantages(tmp_path, monkeypatch):
    """reward=gsm8k_process: step rewards land on their end tokens -> advantages vary along a completion."""
    # a prompt-independent reward: the tiny model's random text gets step scores from the rule verifier;
    # newline-free random characters form one step per completion, so split on any 3 characters instead, and
    # random text makes no arithmetic claim (so no step): every chunk claims, true when it starts below "n"
    from grpo_cli.rewards import steps

    monkeypatch.setattr(steps, "check_claims", lambda chunk: [chunk[:1] < "n"])
    run = tiny_run(tmp_path, *[o for o in TINY if "digit" not in o], "reward=gsm8k_process",
                   "trainer.max_steps=2", "sampler.max_new_tokens=12", "reward.scorer.pattern='(?s).{3}'")
    records = [recipe.step(run, n) for n in (1, 2)]
    for record in records:
        assert record.advantages.shape == record.kept.rollout.completion_ids.shape  # [N, T]: one per token
        assert record.kept.result.steps is not None
    rows = torch.cat([record.advantages for record in records])
    # some completion's advantage changes along its tokens: not one number broadcast over the sequence
    assert any(len(set(row[row != 0].tolist())) > 1 for row in rows)


@pytest.mark.slow  # SIGTERM to a grpo process (~13 s): make test-ci
@pytest.mark.ci
def test_sigterm_checkpoints_and_prints_the_resume_command(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "grpo_cli", "train", *TINY, "trainer.max_steps=1000",
                             "trainer.save_every=1000", f"hydra.run.dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    steps = [r["step"] for r in metrics(tmp_path)]
    assert steps[-1] < 1000
    assert (tmp_path / "checkpoints" / f"step_{steps[-1]:06d}" / "adapter_model.safetensors").exists()
    assert f"resume with: grpo train resume={tmp_path}" in " ".join(out.split())


def test_gradient_checkpointing_gives_the_same_run(tmp_path):
    """Recomputing activations changes memory and time, not the numbers."""
    train.run(tiny_cfg("trainer.max_steps=2"), tmp_path / "plain")
    train.run(tiny_cfg("trainer.max_steps=2", "trainer.gradient_checkpointing=true"), tmp_path / "ckpt")
    a, b = metrics(tmp_path / "plain"), metrics(tmp_path / "ckpt")
    for x, y in zip(a, b):
        for key in ("reward", "loss", "kl", "grad_norm", "entropy"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def test_masked_truncated_completions_get_no_update(tmp_path):
    # random characters rarely reach EOS within 8 tokens: most completions are truncated
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0", "algo.mask_truncated_completions=true"), tmp_path / "m")
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0"), tmp_path / "u")
    masked, unmasked = metrics(tmp_path / "m")[0], metrics(tmp_path / "u")[0]
    complete = round(8 * (1 - masked["completions/clipped_ratio"]))  # 2 prompts x G=4, same rollout in both
    assert complete < 8
    assert masked["counts/backward_seqs"] <= complete < unmasked["counts/backward_seqs"]


def test_bucket_rows_fit_the_token_budget():
    # rows x the longest padded completion <= bucket_tokens, between 1 and 8 rows
    assert update.bucket_rows_for(64, 1024) == 8      # 1024 // 64 = 16, capped at 8
    assert update.bucket_rows_for(256, 1024) == 4     # the GSM8K shape: 4 x 256 = 1024
    assert update.bucket_rows_for(300, 1024) == 3     # 1024 // 300 = 3
    assert update.bucket_rows_for(2048, 1024) == 1    # longer than the budget: one row at a time
    assert update.bucket_rows_for(256, None) == 8     # no budget: 8 rows


def test_the_update_backs_up_buckets_of_the_token_budget(tmp_path, monkeypatch):
    # sampler.max_new_tokens=8 pads completions to at most 8 tokens: a 16-token budget takes 2 rows a bucket
    seen = []
    real = update.buckets

    def spy(model, rollout, **kw):
        for bucket in real(model, rollout, **kw):
            if kw.get("grad"):
                seen.append(len(bucket.rows))
            yield bucket

    monkeypatch.setattr(update, "buckets", spy)
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0.04", "trainer.bucket_tokens=16"), tmp_path / "a")
    assert seen and max(seen) == 2 and sum(seen) == 8  # 2 prompts x G=4, every row once, 2 at a time
    seen.clear()
    train.run(tiny_cfg("trainer.max_steps=1", "algo.beta=0.04", "trainer.bucket_tokens=null"), tmp_path / "b")
    assert seen == [4, 4]  # 8 rows a bucket, within micro-batches of 4
