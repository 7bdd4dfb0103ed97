"""grpo_cli.credit: a RewardResult put on a rollout's tokens (`token_rewards`), and the advantages of that record
(`advantages`), with numbers worked by hand. A character tokenizer makes token t character t, then the EOS."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_cli.credit import TokenRewards, advantages, char_ends_to_token_index, token_rewards
from grpo_cli.policy import char_tokenizer
from grpo_cli.rewards.result import RewardResult
from grpo_cli.rollout import Rollout

TOK = char_tokenizer()
EPS = 1e-4  # the eps added to every std
# the steps of `steps_group`: rewards 1, 0, -1 -> mean 0, population std sqrt(2/3) = 0.816497; normalized
# 1 / (0.816497 + 1e-4) = 1.224595, 0, -1.224595
UP = 1 / (math.sqrt(2 / 3) + EPS)


def rollout_of(texts: list[str], **extra) -> Rollout:
    """One completion per text: its characters, then the EOS; padded with the EOS to the longest."""
    rows = [TOK.encode(t, add_special_tokens=False) + [TOK.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [TOK.eos_token_id] * (width - len(r)) for r in rows])      # [N, T]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])         # [N, T]
    ones = torch.ones(len(texts), 1, dtype=torch.long)
    return Rollout(ones, ones, ids, mask, list(texts), [False] * len(texts), **extra)


def test_outcome_rewards_stay_one_per_completion():
    # G = 4, rewards [1, 0, None, 1]: None is NaN, out of the mean and std. Scored 1, 0, 1: mean 2/3, population std
    # sqrt((1/9 + 4/9 + 1/9) / 3) = sqrt(2/9) = 0.471405 (+ eps: 0.471505)
    #   1 -> (1/3) / 0.471505 = 0.706956;  0 -> -(2/3) / 0.471505 = -1.413912;  None -> 0
    result = RewardResult(rewards=[1.0, 0.0, None, 1.0], per_function={})
    rewards = token_rewards(result, rollout_of(["a", "bc", "d", "ef"]), TOK)
    assert rewards.shape == (4, 3) and rewards.step_rewards is None and rewards.process_weight is None
    assert rewards.outcome.dtype == torch.float32 and math.isnan(rewards.outcome[2])
    adv = advantages(rewards, 4, "group", "population")
    assert adv.shape == (4,)  # [N]: the loss gives every token of a completion its completion's advantage
    std = math.sqrt(2 / 9) + EPS
    assert adv.tolist() == pytest.approx([1 / 3 / std, -2 / 3 / std, 0.0, 1 / 3 / std], abs=1e-5)


def steps_group(process_weight=None, outcome=None) -> tuple[RewardResult, Rollout]:
    """G = 2. Row 0 "ab\\ncd" (tokens 0-4, EOS 5): steps (char_end 2, +1) and (5, 0). Row 1 "x" (token 0, EOS 1):
    one step (2, -1), past the text (len + 1)."""
    result = RewardResult(rewards=[1.0, -1.0], per_function={}, steps=[[(2, 1.0), (5, 0.0)], [(2, -1.0)]],
                          outcome=outcome, process_weight=process_weight)
    return result, rollout_of(["ab\ncd", "x"])


def test_step_rewards_sit_on_the_tokens_ending_their_steps():
    # row 0: char_end 2 ends on "b", token 1; char_end 5 ends on "d", token 4, but it is the final step: it moves to
    # the EOS, token 5 (so stopping gets its credit). Row 1: char_end 2 = len("x") + 1 is the EOS, token 1
    result, rollout = steps_group()
    rewards = token_rewards(result, rollout, TOK)
    assert rewards.shape == (2, 6) and rewards.outcome is None and rewards.credit == "sum"
    assert rewards.step_rows.tolist() == [0, 0, 1]
    assert rewards.step_tokens.tolist() == [1, 5, 1]
    assert rewards.step_rewards.tolist() == [1.0, 0.0, -1.0]
    # normalized: +1.224595, 0, -1.224595; a token gets the sum of its row's steps ending at or after it
    # row 0: tokens 0, 1 -> 1.224595 + 0; tokens 2-5 -> 0. Row 1: tokens 0, 1 -> -1.224595; its padding (2-5) -> 0
    adv = advantages(rewards, 2, "group", "population")
    assert adv.tolist() == [pytest.approx([UP, UP, 0, 0, 0, 0], abs=1e-5),
                            pytest.approx([-UP, -UP, 0, 0, 0, 0], abs=1e-5)]


def test_outcome_and_steps_mix_with_the_weight():
    # λ = 0.5, outcome rewards [1, 0]: G = 2, mean 0.5, population std 0.5 -> ±0.5 / 0.5001 = ±0.999800 on every
    # token. A = A_outcome + 0.5 · A_process: row 0 tokens 0, 1: 0.999800 + 0.612298 = 1.612098, tokens 2-5: 0.999800;
    # row 1 tokens 0, 1: -0.999800 - 0.612298 = -1.612098, tokens 2-5: -0.999800
    result, rollout = steps_group(process_weight=0.5, outcome=[1.0, 0.0])
    rewards = token_rewards(result, rollout, TOK)
    assert rewards.outcome.tolist() == [1.0, 0.0] and rewards.process_weight == 0.5
    adv = advantages(rewards, 2, "group", "population")
    out = 0.5 / (0.5 + EPS)
    assert adv.tolist() == [pytest.approx([out + UP / 2] * 2 + [out] * 4, abs=1e-5),
                            pytest.approx([-out - UP / 2] * 2 + [-out] * 4, abs=1e-5)]
    # no weight: process only, the paper's form; the outcome rewards are not held
    alone = token_rewards(steps_group(outcome=[1.0, 0.0])[0], rollout, TOK)
    assert alone.outcome is None and alone.process_weight is None


def test_turns_are_steps_and_the_environment_gets_no_credit():
    # row 0: turn 1 sampled tokens 0-1, the environment's token 2, turn 2 sampled 3-4; rewards [+1, 0] on tokens 1, 4.
    # row 1: turn 1 token 0, environment 1-2, turn 2 token 3, pad 4; one reward for the episode (-1): its last turn's,
    # on token 3. Normalized as the steps above: +1.224595, 0, -1.224595
    # row 0: tokens 0, 1 -> 1.224595; token 2 (environment) -> 0; tokens 3, 4 -> 0
    # row 1: token 0 -> -1.224595; tokens 1, 2 (environment) -> 0 though a step ends after them; token 3 -> -1.224595
    sampled = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 0, 1, 0]])
    episodes = [SimpleNamespace(turn_ends=[1, 4]), SimpleNamespace(turn_ends=[0, 3])]
    rollout = rollout_of(["abcd", "abc"], sampled_mask=sampled, episodes=episodes)
    result = RewardResult(rewards=[1.0, -1.0], per_function={}, turns=[[1.0, 0.0], [-1.0]])
    rewards = token_rewards(result, rollout, TOK)
    assert rewards.step_rows.tolist() == [0, 0, 1] and rewards.step_tokens.tolist() == [1, 4, 3]
    assert torch.equal(rewards.credited, sampled)
    adv = advantages(rewards, 2, "group", "population")
    assert adv.tolist() == [pytest.approx([UP, UP, 0, 0, 0], abs=1e-5),
                            pytest.approx([-UP, 0, 0, -UP, 0], abs=1e-5)]


def test_a_record_holds_outcome_or_steps():
    steps = {"step_rows": torch.tensor([0]), "step_tokens": torch.tensor([0]), "step_rewards": torch.tensor([1.0])}
    with pytest.raises(ValueError, match="got neither"):
        TokenRewards((1, 1))
    with pytest.raises(ValueError, match="exactly when both"):
        TokenRewards((1, 1), process_weight=0.5, **steps)
    with pytest.raises(ValueError, match="exactly when both"):
        TokenRewards((1, 1), outcome=torch.tensor([1.0]), **steps)


class WordTokenizer:
    """Tokens of several characters: 'The', ' answer', ' is', ' 4', '2', '.'"""

    pieces = ["The", " answer", " is", " 4", "2", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_char_ends_map_to_the_token_holding_the_last_character():
    ids = list(range(6))  # "The answer is 42."
    # char_end 3 -> "The" (token 0); 10 -> " answer" ends at 10 (token 1); 15 -> "4" of " 4" (token 3);
    # 16 -> "2" (token 4); 17 -> "." (token 5); 11 -> " " of " is", inside token 2
    assert char_ends_to_token_index(WordTokenizer(), ids, [3, 10, 11, 15, 16, 17]) == [0, 1, 2, 3, 4, 5]
