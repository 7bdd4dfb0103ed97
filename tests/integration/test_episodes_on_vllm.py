"""Multi-turn episodes on vLLM (the engine continuing token ids) against HF generate, on the embedded SmolLM2: the
same greedy episodes (texts, tool calls, every id), and sampled episodes drawn from the caller's generator.

The prompt demonstrates two calls in earlier turns (a user question, the assistant's `<tool_call>`, the tool's
result, the answer), so that the 135M model calls the tool itself on the next question.
"""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config import compose
from tests.helpers.engines import needs_vllm
from tests.helpers.runs import sampler_settings
from tests.helpers.tools import MULTIPLY_TOOL

pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.ci]


def demonstrated(a: int, b: int) -> list[dict]:
    """One demonstrated call: the question, the assistant's call, the tool's result, the answer."""
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    return [{"role": "user", "content": f"What is {a} times {b}?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]


# the 135M model calls the tool after two demonstrations (one is not enough for it)
DEMO = [{"role": "system", "content": "You are a calculator. To multiply, call the multiply tool, then answer with "
                                      "its result."}, *demonstrated(3, 4), *demonstrated(21, 5)]
EXAMPLES = [{"messages": [*DEMO, {"role": "user", "content": q}], "question": q}
            for q in ("What is 123 times 45?", "What is 17 times 23?")]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(policy, tokenizer, HF generate's EpisodeSampler, vLLM's, started and sized for the episodes)."""
    from grpo_cli.instantiate import build
    from grpo_cli.policy import build_policy
    from grpo_cli.rollout.episodes import EpisodeSampler
    from grpo_cli.rollout.hf import HFSampler
    from grpo_cli.rollout.sizing import Job
    from grpo_cli.rollout.vllm import VLLMSampler

    tools = tmp_path_factory.mktemp("tools") / "calc.py"
    tools.write_text(MULTIPLY_TOOL)
    cfg = compose("train", ["sampler=vllm", "env=tools", f"env.tools=[{tools}:multiply]", "env.max_turns=3",
                            "env.max_episode_tokens=64"])
    policy, tokenizer, _ = build_policy(cfg.model)
    policy.eval()
    hf = EpisodeSampler(HFSampler(**sampler_settings()), build(cfg.env))
    # an eager engine: no model compile at its start (~30 s of the suite's CPU); the compiled engine's greedy
    # tokens against HF generate's are test_vllm_sampler's (slow tier), its start the default run's
    # (tests/system/test_process.py)
    vllm = EpisodeSampler(VLLMSampler(**sampler_settings("vllm", enforce_eager=True)), build(cfg.env))
    vllm.start(policy, cfg.sampler, Job(len(EXAMPLES), 2))
    assert vllm.sampler.llm is not None and vllm.sampler.fallback is None
    return policy, tokenizer, hf, vllm


@pytest.fixture(scope="module")
def greedy(engines):
    """vLLM's greedy episodes of EXAMPLES, sampled once for the tests that read them (~8 s of the real model)."""
    policy, tokenizer, _, vllm = engines
    return vllm.sample(policy, tokenizer, EXAMPLES, 1, greedy=True)


def test_vllm_and_hf_generate_give_the_same_greedy_episodes(engines, greedy):
    policy, tokenizer, hf, _ = engines
    theirs = hf.sample(policy, tokenizer, EXAMPLES, 1, greedy=True)
    ours = greedy
    assert [e.tool_calls for e in ours.episodes] == [1, 1]  # the model calls the tool itself
    assert [e.messages for e in ours.episodes] == [e.messages for e in theirs.episodes]  # texts, calls, results
    assert [e.completion_ids for e in ours.episodes] == [e.completion_ids for e in theirs.episodes]
    assert [e.sampled for e in ours.episodes] == [e.sampled for e in theirs.episodes]
    assert ours.texts == theirs.texts and [e.stop for e in ours.episodes] == [e.stop for e in theirs.episodes]


def test_vllm_episodes_sample_from_the_callers_generator(engines, tmp_path):
    from grpo_cli.instantiate import build
    from grpo_cli.rollout.episodes import EpisodeSampler

    policy, tokenizer, _, started = engines
    (tmp_path / "calc.py").write_text(MULTIPLY_TOOL)
    # the same engine, short episodes: what is checked is where the ids come from, not what they say
    env = build(compose("train", ["env=tools", f"env.tools=[{tmp_path / 'calc.py'}:multiply]",
                                  "env.max_episode_tokens=16"]).env)
    vllm = EpisodeSampler(started.sampler, env)

    def draw(seed):
        rollout = vllm.sample(policy, tokenizer, EXAMPLES[:1], 2, generator=torch.Generator().manual_seed(seed))
        return [e.completion_ids for e in rollout.episodes]

    state = torch.get_rng_state()
    first = draw(1)
    assert first == draw(1) and first != draw(2)  # a run and its resume draw the same episodes
    assert first[0] != first[1]  # each row its own seed
    assert torch.equal(torch.get_rng_state(), state)  # torch's global generator is left as it was


def test_vllm_episodes_keep_the_samplers_log_probs_of_the_sampled_tokens_only(engines, greedy):
    from grpo_cli.logprobs import sequence_logprobs
    from grpo_cli.objective import GRPOLoss, LossSettings

    policy, _, _, _ = engines
    rollout = greedy
    assert [e.tool_calls for e in rollout.episodes] == [1, 1]  # each episode holds a tool turn: environment ids
    with torch.no_grad():
        trainer = sequence_logprobs(policy, rollout).logp  # [N, T] the trainer's log-probs of the episode's ids
    sampled = rollout.loss_mask.bool()
    environment = rollout.completion_mask.bool() & ~sampled
    assert environment.any() and (rollout.sampling_logp[environment] == 0).all()  # the environment's: none
    # the sampled ids: vLLM's log-probs within the single-turn test's tolerance (test_vllm_sampler.py)
    gap = (trainer - rollout.sampling_logp)[sampled].abs()
    print(f"episodes: mean |vLLM - trainer| log-prob {gap.mean():.2e}, max {gap.max():.2e} over {sampled.sum()} "
          f"sampled tokens ({environment.sum()} environment tokens left out)")
    assert gap.mean() < 1e-3 and gap.max() < 1e-2
    # the loss reads them as the trainer does (algo.is_correction_cap=2): sampler/logp_gap is the sampled tokens'
    # gap, while the environment's ids, had they counted, would have added their own -log p (the template's
    # markers and the tool's digits are far from certain for the model)
    loss = GRPOLoss(LossSettings(beta=0.0, epsilon_low=0.2, epsilon_high=None, kl_estimator="k3", loss_type="grpo",
                                 is_correction_cap=2.0))
    mask = rollout.loss_mask.float()
    loss_fn = loss.for_batch(mask.shape[0], mask.sum(), mask.shape[1])
    _, stats = loss_fn(trainer, trainer, None, torch.zeros(mask.shape[0]), mask,  # advantages [N]
                       sampling_logp=rollout.sampling_logp)
    assert float(stats["sampler/logp_gap"]) == pytest.approx(float(gap.mean()), abs=1e-6)
    assert float(trainer[environment].abs().mean()) > 100 * float(gap.mean())
    assert abs(float(stats["sampler/is_weight_mean"]) - 1) < 1e-2  # π_old / π_sampler ≈ 1 on every sampled token
