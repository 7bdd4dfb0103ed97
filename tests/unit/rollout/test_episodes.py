"""Episodes as a sampler: HF generate as the episodes' engine, and `EpisodeSampler.sample` returning a Rollout whose
environment tokens are context the loss does not score."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.env import ToolsEnv
from grpo_cli.logprobs import sequence_logprobs
from grpo_cli.policy import apply_lora, load_tiny_random
from grpo_cli.rollout import encode_prompts, render_prompts
from grpo_cli.rollout.episodes import EpisodeSampler
from grpo_cli.rollout.hf import HFSampler
from tests.helpers.runs import sampler_settings
from tests.helpers.tools import MULTIPLY_TOOL, TOOL_CALL

EXAMPLES = [{"messages": [{"role": "user", "content": q}], "question": q, "answer": a}
            for q, a in (("what is 4 * 3?", "12"), ("what is 5 * 5?", "25"))]


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_tiny_random()
    return apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"]), tokenizer


def tools_env(tmp_path, **limits) -> ToolsEnv:
    (tmp_path / "tools.py").write_text(MULTIPLY_TOOL)
    values = dict(max_turns=3, max_tool_calls=4, max_episode_tokens=120, tool_timeout_s=5.0, max_result_chars=100)
    return ToolsEnv([f"{tmp_path / 'tools.py'}:multiply"], "chatml", **{**values, **limits})


class Scripted:
    """An engine whose first turn in every row is TOOL_CALL and whose later turns are the answer "12"."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.eos_token_id

    def continue_batch(self, sequences, max_new):
        out = []
        for seq in sequences:
            text = "12" if TOOL_CALL in self.tokenizer.decode(seq) else TOOL_CALL  # called already: the answer
            out.append((self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id])[:max_new])
        return out


def test_hf_engine_continues_token_ids_as_greedy_generate_does(policy):
    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    prompts = render_prompts(tokenizer, [e["messages"] for e in EXAMPLES])
    greedy = sampler.generate(model, tokenizer, prompts, 1, greedy=True)
    ids, mask = encode_prompts(tokenizer, prompts)
    sequences = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # ragged, no padding
    new = sampler.engine(model, tokenizer, greedy=True, generator=None).continue_batch(sequences, 12)
    # the same ids, each row cut after its EOS (kept) or at 12
    assert new == [row[m.bool()].tolist() for row, m in zip(greedy.completion_ids, greedy.completion_mask)]


def test_hf_engine_samples_from_the_callers_generator(policy):
    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    seq = [encode_prompts(tokenizer, render_prompts(tokenizer, [EXAMPLES[0]["messages"]]))[0][0].tolist()] * 3

    def draw(seed):
        engine = sampler.engine(model, tokenizer, greedy=False, generator=torch.Generator().manual_seed(seed))
        return engine.continue_batch(seq, 12)

    state = torch.get_rng_state()
    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert torch.equal(torch.get_rng_state(), state)  # torch's global generator is left as it was


def test_episode_sampler_returns_grouped_rows_with_the_environment_tokens_masked(policy, tmp_path, monkeypatch):
    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    # scripted: every episode calls multiply(4, 3) in its first turn and answers "12" after reading the result
    monkeypatch.setattr(HFSampler, "engine", lambda self, *a, **k: Scripted(tokenizer))
    episodes = EpisodeSampler(sampler, tools_env(tmp_path))
    rollout = episodes.sample(model, tokenizer, EXAMPLES, 3)
    assert len(rollout.texts) == 6 and [len(e.messages) for e in rollout.episodes] == [3] * 6
    first = rollout.episodes[0]
    assert first.messages[1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert first.tool_calls == 1 and first.turns == 2 and first.stop == "answer"
    # the completion ids are the episode's; 1 in sampled_mask exactly where the model sampled
    t = len(first.completion_ids)
    assert rollout.completion_ids[0, :t].tolist() == first.completion_ids
    assert rollout.sampled_mask[0, :t].tolist() == first.sampled and 0 in first.sampled
    call_ids = len(tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]) + 1  # the call and its EOS
    answer_ids = 3  # "12" and its EOS
    assert rollout.lengths == [call_ids + answer_ids] * 6  # lengths count sampled ids only
    assert TOOL_CALL in rollout.texts[0] and rollout.texts[0].endswith("12") and rollout.truncated == [False] * 6
    # the prompt rows are the rendered prompt with the tools' schema: rows 0-2 share example 0's prompt
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])
    assert "multiply" in tokenizer.decode(rollout.prompt_ids[3][rollout.prompt_mask[3].bool()])
    # the trainer scores the sequence as sampled: log-probs on every completion id, environment ids included
    assert sequence_logprobs(model, rollout).logp.shape == rollout.completion_ids.shape


class ScriptedWithLogprobs(Scripted):
    """Scripted, as an engine with its own weights (vLLM) answers: each returned id's log-prob beside it, here
    -0.01 times its place in the turn (-0.01, -0.02, ...)."""

    def continue_batch(self, sequences, max_new):
        out = super().continue_batch(sequences, max_new)
        self.logprobs = [[-0.01 * (k + 1) for k in range(len(ids))] for ids in out]
        return out


def test_episodes_keep_the_engines_log_probs_of_the_sampled_ids_and_none_for_the_environments(policy, tmp_path,
                                                                                                monkeypatch):
    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    monkeypatch.setattr(HFSampler, "engine", lambda self, *a, **k: ScriptedWithLogprobs(tokenizer))
    rollout = EpisodeSampler(sampler, tools_env(tmp_path)).sample(model, tokenizer, EXAMPLES, 2)
    first = rollout.episodes[0]
    call_ids = len(tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"]) + 1  # the call and its EOS
    added = first.sampled.count(0)  # the environment's ids between the turns
    # turn 1: -0.01 .. -0.01 * call_ids; the environment's ids: 0; turn 2 ("12" and EOS): -0.01, -0.02, -0.03
    expected = [-0.01 * (k + 1) for k in range(call_ids)] + [0.0] * added + [-0.01, -0.02, -0.03]
    t = len(first.completion_ids)
    assert rollout.sampling_logp[0, :t].tolist() == pytest.approx(expected)
    assert rollout.sampling_logp[0, t:].abs().sum() == 0  # pad
    # where the loss reads them (sampler/logp_gap, the IS weights): the sampled ids only
    assert rollout.loss_mask[0, :t].tolist() == first.sampled
    # an engine that samples from the policy itself keeps none
    monkeypatch.setattr(HFSampler, "engine", lambda self, *a, **k: Scripted(tokenizer))
    assert EpisodeSampler(sampler, tools_env(tmp_path)).sample(model, tokenizer, EXAMPLES, 2).sampling_logp is None


def test_episode_sampler_on_hf_generate_runs_and_stops_at_the_budget(policy, tmp_path):
    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    episodes = EpisodeSampler(sampler, tools_env(tmp_path, max_episode_tokens=10))
    rollout = episodes.sample(model, tokenizer, EXAMPLES, 2, generator=torch.Generator().manual_seed(0))
    # the tiny random model rarely writes EOS: its episodes end at the budget of 10 sampled ids, truncated
    assert all(n <= 10 for n in rollout.lengths) and len(rollout.episodes) == 4
    assert rollout.truncated == [e.stop == "budget" for e in rollout.episodes]


def test_episodes_run_on_vllm_as_plain_completions_do(tmp_path, monkeypatch):
    from grpo_cli.config import validate
    from grpo_cli.errors import ConfigError
    from grpo_cli.rollout.engine import run_refusal
    from tests.helpers.runs import tiny_cfg

    (tmp_path / "tools.py").write_text(MULTIPLY_TOOL)
    env = ["env=tools", f"env.tools=[{tmp_path / 'tools.py'}:multiply]"]
    monkeypatch.setattr("grpo_cli.rollout.vllm_engine.installed", lambda: True)
    # sampler=auto picks vLLM with an environment where it would without one, and sampler=vllm validates
    assert run_refusal(tiny_cfg(*env), 1) is None
    validate(tiny_cfg(*env, "sampler=vllm"))
    # episodes keep the engine's log-probs, so the IS correction validates with them as without
    validate(tiny_cfg(*env, "sampler=vllm", "algo.is_correction_cap=2"))
    # what episodes on vLLM cannot do yet, one line before the model loads: an engine split over ranks (each rank's
    # episodes take their own number of turns)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^multi-turn episodes .* set sampler.tensor_parallel_size=1$"):
        validate(tiny_cfg(*env, "sampler=vllm", "sampler.tensor_parallel_size=2", "trainer.prompts_per_step=4"))


def test_the_episode_budget_must_fit_the_context_with_the_prompt(tmp_path):
    from grpo_cli.config import validate
    from grpo_cli.errors import ConfigError
    from tests.helpers.runs import tiny_cfg

    (tmp_path / "tools.py").write_text(MULTIPLY_TOOL)
    env = ["env=tools", f"env.tools=[{tmp_path / 'tools.py'}:multiply]", "sampler.max_prompt_tokens=1024"]
    validate(tiny_cfg(*env, "env.max_episode_tokens=1024"))  # 1024 + 1024 = the tiny model's 2048
    # every token after the prompt counts, so the episode's budget, not sampler.max_new_tokens, must fit
    with pytest.raises(ConfigError, match=r"env.max_episode_tokens \(1025\) exceed .* env.max_episode_tokens=1024"):
        validate(tiny_cfg(*env, "env.max_episode_tokens=1025"))


def test_a_prompt_longer_than_max_prompt_tokens_with_the_tools_shown_is_one_line(policy, tmp_path):
    from grpo_cli.errors import DataError

    model, tokenizer = policy
    # the tiny tokenizer spends a token per character: the tools' schema alone is hundreds of tokens
    sampler = HFSampler(**sampler_settings(max_new_tokens=12, max_prompt_tokens=64))
    with pytest.raises(DataError, match=r"with the tools' schemas .* sampler.max_prompt_tokens \(64\)"):
        EpisodeSampler(sampler, tools_env(tmp_path)).sample(model, tokenizer, EXAMPLES, 2)


def test_a_reward_per_turn_lands_on_each_turns_last_sampled_token(policy, tmp_path, monkeypatch):
    from grpo_cli.credit import advantages, token_rewards
    from grpo_cli.rewards import OutcomeReward
    from grpo_cli.rewards.call import score

    model, tokenizer = policy
    sampler = HFSampler(**sampler_settings(max_new_tokens=12))
    monkeypatch.setattr(HFSampler, "engine", lambda self, *a, **k: Scripted(tokenizer))
    rollout = EpisodeSampler(sampler, tools_env(tmp_path)).sample(model, tokenizer, EXAMPLES, 3)
    # every episode: turn 1 is TOOL_CALL + EOS, then the tool turn the environment adds, then turn 2 is "12" + EOS

    def per_turn(prompts, completions, **columns):
        # a list scores each assistant turn; a number scores the episode, on its last turn; a list of the wrong
        # length is no score
        return [[1.0, 0.0], [0.0, 1.0], 2.0, 1.0, 0.0, [5.0]]

    reward = OutcomeReward({"per_turn": per_turn}, None, None, worker="thread")
    result = score(reward, EXAMPLES, rollout)  # rows 0-2 answer EXAMPLES[0], rows 3-5 EXAMPLES[1]
    assert result.rewards == [1.0, 1.0, 2.0, 1.0, 0.0, None]  # each episode's sum of its turns
    adv = advantages(token_rewards(result, rollout, tokenizer), 3, "group", "population")  # [6, T]
    first, last = rollout.episodes[0].turn_ends  # each turn's last sampled id (its EOS)
    n = len(rollout.episodes[0].completion_ids)
    sampled = torch.tensor(rollout.episodes[0].sampled, dtype=torch.bool)
    # group 0's turn rewards 1, 0 | 0, 1 | -, 2: mean 4/5 = 0.8, population var (.04 + .64 + .64 + .04 + 1.44) / 5
    # = 0.56; a turn's token gets the normalized rewards of its turn and of the turns after it
    z = {r: (r - 0.8) / (0.56 ** 0.5 + 1e-4) for r in (0.0, 1.0, 2.0)}
    expect = {0: (z[1.0] + z[0.0], z[0.0]), 1: (z[0.0] + z[1.0], z[1.0]), 2: (z[2.0], z[2.0])}
    # group 1: 1, 0 on the last turns, row 5 unscored (normalized to 0): mean 1/2, std 1/2 -> +-1 (eps aside)
    z1 = 0.5 / (0.5 + 1e-4)
    expect.update({3: (z1, z1), 4: (-z1, -z1), 5: (0.0, 0.0)})
    for row, (turn1, turn2) in expect.items():
        want = torch.zeros(n)
        want[:first + 1], want[first + 1:last + 1] = turn1, turn2
        want[~sampled] = 0.0  # the environment's tokens carry no advantage
        assert torch.allclose(adv[row, :n], want, atol=1e-5), row
    assert (adv[:, n:] == 0).all()  # padding
