"""Process credit without a length term (issue #27): properties of the step scoring on random groups, through the
trainer's own path (conf/reward/multistep_process.yaml -> score -> credit.token_rewards -> credit.advantages, a
character tokenizer so token t is character t and the EOS is the last token), and the outcome + λ·process
combination worked by hand."""

from __future__ import annotations

import random

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_cli.credit import advantages, token_rewards
from grpo_cli.data import load_task
from grpo_cli.policy import char_tokenizer
from grpo_cli.resources import CONF_DIR
from grpo_cli.rewards import RewardResult, extract_answer
from grpo_cli.rollout import Rollout

TOK = char_tokenizer()
# lines without a claim and without a digit (so the text's final number, its answer, stays what it was)
CLAIM_FREE = ["Let me check.", "Hmm, next.", "So we go on.", "Now add them", "Done"]


def reward(process_weight=None):
    cfg = OmegaConf.load(CONF_DIR / "reward" / "multistep_process.yaml")
    if "process_weight" in cfg:
        cfg.process_weight = process_weight
    return instantiate(cfg)


def group_advantages(texts: list[str], example: dict, truncated: list[bool] | None = None,
                     process_weight=None) -> tuple[torch.Tensor, RewardResult]:
    """([G, T] advantages of one group of completions of `example`, the reward result); row i's tokens are its
    characters, then its EOS."""
    truncated = truncated or [False] * len(texts)
    rows = [TOK.encode(t, add_special_tokens=False) + [TOK.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [TOK.eos_token_id] * (width - len(r)) for r in rows])     # [G, T], pad = eos
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    rollout = Rollout(torch.ones(len(texts), 1, dtype=torch.long), torch.ones(len(texts), 1, dtype=torch.long),
                      ids, mask, list(texts), list(truncated))
    columns = {"answer": [example["answer"]] * len(texts), "solution": [example["solution"]] * len(texts),
               "truncated": list(truncated)}
    result = reward(process_weight)(["q"] * len(texts), list(texts), columns)
    return advantages(token_rewards(result, rollout, TOK), len(texts), "group", "population"), result


def random_completion(rng: random.Random, example: dict, task) -> list[str]:
    """Lines of a plausible completion: reference steps (some perturbed), unrelated true claims, claim-free lines."""
    lines = []
    for line in example["solution"].split("\n")[:rng.randint(0, 3)]:
        if rng.random() < 0.3:
            line = line.rsplit(" ", 1)[0] + f" {int(line.rsplit(' ', 1)[1]) + rng.choice([-1, 1])}"
        lines.append(line)
        if rng.random() < 0.3:
            lines.append(rng.choice(CLAIM_FREE))
    if rng.random() < 0.3:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.insert(rng.randint(0, len(lines)), f"{a} + {b} = {a + b}")
    if not lines or rng.random() < 0.2:
        lines.append(f"The answer is {rng.randint(0, 20)}.")
    return lines


def random_group(seed: int):
    """(example, each completion's lines, the texts, their [G, T] advantages, the rng, a row to change)."""
    rng = random.Random(seed)
    task = load_task("multistep")
    example = task.train[rng.randrange(1000)]
    group = [random_completion(rng, example, task) for _ in range(rng.randint(2, 8))]
    texts = ["\n".join(lines) for lines in group]
    return example, group, texts, group_advantages(texts, example)[0], rng, rng.randrange(len(group))


def replaced(texts: list[str], i: int, text: str) -> list[str]:
    return texts[:i] + [text] + texts[i + 1:]


@pytest.mark.parametrize("seed", range(40))
def test_a_claim_free_line_changes_no_tokens_advantage(seed):
    # issue #27: "So the answer is 5." / "Let me check." turned a wrong answer's first-token advantage from -0.16 to
    # +0.70 when claim-free lines scored 0 and counted in the group's mean; now they are no step at all
    example, group, texts, before, rng, i = random_group(seed)
    at = rng.randint(0, len(group[i]))
    padded = group[i][:at] + [rng.choice(CLAIM_FREE)] + group[i][at:]
    after, _ = group_advantages(replaced(texts, i, "\n".join(padded)), example)
    for row in range(len(texts)):
        if row == i:
            continue
        n = len(texts[row]) + 1  # its characters and its EOS
        assert after[row, :n].tolist() == pytest.approx(before[row, :n].tolist(), abs=1e-5), texts[row]
    # row i: every character of the old text (and the EOS) keeps its advantage at its new position
    old, new = texts[i], "\n".join(padded)
    start = len("\n".join(group[i][:at])) + (1 if at else 0)   # where the inserted line begins in the new text
    shift = len(padded[at]) + 1
    kept = [t if t < start else t + shift for t in range(len(old) + 1)]
    if at == len(group[i]) and at:  # appended: the old text's chars keep their place, the new line follows them
        kept = list(range(len(old))) + [len(new)]
    assert [after[i, t].item() for t in kept] == pytest.approx(before[i, :len(old) + 1].tolist(), abs=1e-5), (old, new)


@pytest.mark.parametrize("seed", range(40))
def test_padding_with_a_claim_line_never_raises_the_first_tokens_advantage(seed):
    # a claim line appended after the completion's last line that is not the reference's next step: it fills a slot
    # the completion left empty with a wrong step (-1 for -1) or is an extra step (-1 more); either way the first
    # token's advantage, the sum of the completion's normalized step rewards, does not rise
    example, group, texts, before, rng, i = random_group(seed)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    line = rng.choice([f"{a} + {b} = {a + b}", f"{a} + {b} = {a + b + 1}"])
    if " ".join(line.split()) in example["solution"].split("\n"):  # could be the reference's next step: not padding
        line = f"{a} + {b} = {a + b + 1}"
    # the completion's final answer stays what it was (a claim line's result would become it): restate it after
    lines = group[i][:-1] + [line, group[i][-1]] if "answer" in group[i][-1] else (
        group[i] + [line, f"The answer is {extract_answer(texts[i])}."])
    padded = "\n".join(lines)
    after, _ = group_advantages(replaced(texts, i, padded), example)
    assert after[i, 0].item() <= before[i, 0].item() + 1e-5, (texts[i], padded)


@pytest.mark.parametrize("seed", range(40))
def test_a_truncated_completion_never_scores_above_the_same_text_finished(seed):
    example, group, texts, _, rng, i = random_group(seed)
    cut = [row == i for row in range(len(texts))]
    _, finished = group_advantages(texts, example)
    _, truncated = group_advantages(texts, example, truncated=cut)
    assert truncated.rewards[i] <= finished.rewards[i]
    # step by step too: only the answer's step can change, and only downwards
    assert all(t[1] <= f[1] for t, f in zip(truncated.steps[i], finished.steps[i], strict=True))
    # a right answer that ran into the cap scores outcome_truncated (-2), below a wrong answer (-1)
    right = example["solution"]
    _, done = group_advantages([right, "x"], example)
    _, cut_off = group_advantages([right, "x"], example, truncated=[True, False])
    assert done.steps[0][-1][1] == 1.0 and cut_off.steps[0][-1][1] == -2.0


def test_the_issue_example_padding_no_longer_pays():
    # issue #27's worked case: a wrong three-line answer, then the same text plus two claim-free lines; with
    # claim-free lines scored 0 and counted, the padded one's first-token advantage rose from -0.16 to +0.70
    example = {"question": "Compute 6 - 3 + 8 - 7.", "answer": "4", "solution": "6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4"}
    wrong = "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5"
    others = ["6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4", "6 - 3 = 3", "3 + 8 = 11", "6 + 3 = 9", "The answer is 4.",
              "6 - 3 = 3\n3 + 8 = 11"]
    plain, _ = group_advantages([wrong] + others, example)
    padded, _ = group_advantages([wrong + "\nSo the answer is 5.\nLet me check."] + others, example)
    assert padded[0, 0].item() == pytest.approx(plain[0, 0].item(), abs=1e-5)
    assert plain[0, 0].item() < 0


def test_outcome_plus_process_by_hand():
    # λ = 0.5, one group of 2 on "Compute 6 - 3 + 8 - 7." (answer 4):
    #   A: the reference, 3 right lines (+1 each), answer right +1        -> steps +1 +1 +1 +1, accuracy 1
    #   B: "6 - 3 = 3" then stop: +1, two slots missing -1 -1, answer 3 wrong -1 -> steps +1 -1 -1 -1, accuracy 0
    # outcome: rewards 1, 0: mean 0.5, population std 0.5 -> A +1, B -1 (eps 1e-4: 0.5 / 0.5001)
    # process: the 8 step rewards, five +1 and three -1: mean 0.25, population std sqrt(1 - 0.0625) = 0.968246
    #   (+ eps 1e-4: 0.968346); normalized +1 -> 0.75 / 0.968346 = 0.774516, -1 -> -1.25 / 0.968346 = -1.290860
    #   A's first token: 4 x 0.774516 = 3.098064; B's: 0.774516 - 3 x 1.290860 = -3.098064
    #   A's "\n" after its first line (char 9): the 3 steps still to come, 2.323548; B is one line whose step and two
    #   unwritten slots end at its last character (where its chain stopped) and whose answer ends with the completion
    #   (its EOS): 9 chars + EOS
    # A = A_outcome + 0.5 A_process: A's first token 0.999800 + 1.549032 = 2.548832; B's -2.548832
    example = {"question": "Compute 6 - 3 + 8 - 7.", "answer": "4", "solution": "6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4"}
    adv, result = group_advantages([example["solution"], "6 - 3 = 3"], example, process_weight=0.5)
    o, sd = 0.5 / (0.5 + 1e-4), (1 - 0.0625) ** 0.5 + 1e-4
    up, down = 0.75 / sd, -1.25 / sd
    assert result.outcome == [1.0, 0.0] and result.process_weight == 0.5
    assert adv[0, 0].item() == pytest.approx(o + 0.5 * 4 * up, abs=1e-5)
    assert adv[0, 0].item() == pytest.approx(2.548832, abs=1e-5)
    assert adv[0, 9].item() == pytest.approx(o + 0.5 * 3 * up, abs=1e-5)    # "\n" after line 1: 3 steps left
    assert adv[1, :9].tolist() == pytest.approx([-o + 0.5 * (up + 3 * down)] * 9, abs=1e-5)  # its 9 characters
    # its EOS, the decision to stop after one line: the outcome and the answer's step alone (the unwritten slots end
    # on its last character, so stopping is not charged for them: -0.999800 + 0.5 x -1.290860 = -1.645230)
    assert adv[1, 9].item() == pytest.approx(-o + 0.5 * down, abs=1e-5)
    # null (or inf): the step rewards alone, the paper's form
    alone, result = group_advantages([example["solution"], "6 - 3 = 3"], example, process_weight=None)
    assert result.outcome is None and alone[0, 0].item() == pytest.approx(4 * up, abs=1e-5)
    inf, _ = group_advantages([example["solution"], "6 - 3 = 3"], example, process_weight=float("inf"))
    assert torch.equal(inf, alone)


def test_process_weight_needs_an_outcome_function():
    from grpo_cli.errors import ConfigError
    from grpo_cli.rewards import ProcessReward
    from grpo_cli.rewards.steps import step_rewards

    with pytest.raises(ConfigError, match="reward.process_weight"):
        ProcessReward(step_rewards, outcome=None, timeout_s=10.0, process_weight=1.0, worker="process", credit="sum")


# ---- issue #44: credit without an incentive to stop early or ramble to the cap -------------------------------------
EX = {"question": "Compute 6 - 3 + 8 - 7.", "answer": "4", "solution": "6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4"}
# a group's other completions: the reference, a wrong chain, an unrelated true line, a bare answer
OTHERS = ["6 - 3 = 3\n3 + 8 = 11\n11 - 7 = 4", "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5", "6 + 3 = 9", "The answer is 4."]
# what fills a truncated tail: claim-free lines, the prefix's lines again, unrelated true arithmetic
RAMBLES = {"claim_free": "\nLet me check.\nHmm, next.\nSo we go on.",
           "repeats": "\n6 - 3 = 3\n6 - 3 = 3\n6 - 3 = 3",
           "unrelated": "\n2 + 2 = 4\n1 + 1 = 2"}
PREFIXES = ["6 - 3 = 3", "6 - 3 = 3\n3 + 8 = 11", EX["solution"]]


@pytest.mark.parametrize("ramble", sorted(RAMBLES))
@pytest.mark.parametrize("prefix", PREFIXES)
def test_stopping_after_a_correct_prefix_beats_rambling_to_the_cap(prefix, ramble):
    # S: the correct prefix, then EOS; R: the same prefix, then lines until sampler.max_new_tokens cut it (truncated).
    # Both in one group: every token of the shared prefix, and the token where S stops (R's next token), must pay S
    # more than R. A tie is the issue's "truncation is free": nothing in the gradient says stop.
    stop, rambled = prefix, prefix + RAMBLES[ramble]
    adv, _ = group_advantages([stop, rambled, *OTHERS], EX, truncated=[False, True] + [False] * len(OTHERS))
    n = len(prefix)
    assert all(s > r + 1e-4 for s, r in zip(adv[0, :n].tolist(), adv[1, :n].tolist())), (prefix, ramble)
    assert adv[0, n].item() > adv[1, n].item() + 1e-4, "the stop point: S's EOS vs R's first rambling token"


@pytest.mark.parametrize("ramble", sorted(RAMBLES))
def test_truncation_costs_more_than_a_wrong_final_answer(ramble):
    # W: a wrong chain that finishes with its wrong answer; T: the same chain, then lines until the cap. Running to the
    # cap must cost more than answering wrongly: in the completion's reward and at its first token
    wrong = "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5"
    adv, result = group_advantages([wrong, wrong + RAMBLES[ramble], *OTHERS], EX,
                                   truncated=[False, True] + [False] * len(OTHERS))
    assert result.rewards[1] < result.rewards[0]
    assert adv[1, 0].item() < adv[0, 0].item() - 1e-4


@pytest.mark.parametrize("prefix", PREFIXES[:2])
def test_a_short_chain_stopping_is_no_worse_than_continuing_wrongly(prefix):
    # S: a correct prefix of j < 3 lines, then EOS; W: the same prefix, then wrong lines for the remaining slots and
    # EOS. The decision to stop (S's EOS) must not carry the unwritten slots on its own: it may not be worse than W's
    # decision to stop, nor than W's token at the same place (its decision to continue wrongly)
    lines = prefix.split("\n")
    wrong_rest = ["3 + 8 = 12", "12 - 7 = 5"][len(lines) - 1:]
    stop, wrong = prefix, "\n".join(lines + wrong_rest)
    adv, _ = group_advantages([stop, wrong, *OTHERS], EX)
    n = len(prefix)
    assert adv[0, n].item() >= adv[1, len(wrong)].item() - 1e-5, "S's EOS vs W's EOS"
    assert adv[0, n].item() >= adv[1, n].item() - 1e-5, "S's EOS vs W's next token"


def test_the_stop_token_by_hand():
    # one group of 2: S = "6 - 3 = 3" then EOS, W = "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5" then EOS (answer 5, wrong)
    #   S: line +1, slots 2 and 3 never written -1 -1 (at the end of its last claim line, char 8), answer -1 (EOS)
    #   W: line +1, two wrong lines -1 -1, answer -1 (EOS)
    # 8 step rewards, two +1 and six -1: mean -0.5, population std sqrt(1 - 0.25) = 0.866025 (+ eps 1e-4: 0.866125)
    #   normalized +1 -> 1.5 / 0.866125 = 1.731852, -1 -> -0.5 / 0.866125 = -0.577284
    # S's EOS carries its answer alone: -0.577284 (before: the two slots too, 3 x -0.577284 = -1.731852), and so does
    # W's: stopping is judged the same after a short correct chain as after a wrong one
    adv, _ = group_advantages(["6 - 3 = 3", "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5"], EX)
    down = -0.5 / (0.75 ** 0.5 + 1e-4)
    assert adv[0, 9].item() == pytest.approx(down, abs=1e-5)
    assert adv[1, 31].item() == pytest.approx(down, abs=1e-5)       # W's 31 characters, then its EOS
    # every character of S's line carries the line, the slots and the answer: 1.731852 + 3 x -0.577284 = 0
    assert adv[0, :9].tolist() == pytest.approx([0.0] * 9, abs=1e-5)


def test_min_credit_through_the_trainer():
    # reward.credit=min on the same group as test_the_stop_token_by_hand (S = "6 - 3 = 3", W = a slip on line 2):
    # normalized +1 -> 1.731852, -1 -> -0.577284. W's first line is right, but the wrong line after it caps its
    # characters at -0.577284 under min (under sum they carry 1.731852 - 3 x 0.577284 = 0): a right step cannot pay
    # for a wrong one after it. S's line is capped by its unwritten slots the same way
    cfg = OmegaConf.load(CONF_DIR / "reward" / "multistep_process.yaml")
    cfg.credit = "min"
    texts = ["6 - 3 = 3", "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5"]
    rows = [TOK.encode(t, add_special_tokens=False) + [TOK.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [TOK.eos_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    rollout = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), ids, mask, texts,
                      [False, False])
    result = instantiate(cfg)(["q"] * 2, texts, {"answer": ["4"] * 2, "solution": [EX["solution"]] * 2,
                                                  "truncated": [False] * 2})
    adv = advantages(token_rewards(result, rollout, TOK), 2, "group", "population")
    down = -0.5 / (0.75 ** 0.5 + 1e-4)
    assert result.credit == "min"
    assert adv[1, :9].tolist() == pytest.approx([down] * 9, abs=1e-5)
    assert adv[0, :10].tolist() == pytest.approx([down] * 10, abs=1e-5)


def test_credit_is_refused_on_an_outcome_reward():
    from grpo_cli.config import compose, validate
    from grpo_cli.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose("train", ["+reward.credit=min"]))
    assert ("reward.credit (min) gathers step rewards, and reward (grpo_cli.rewards.OutcomeReward) gives one reward "
            "per completion: use a process reward (reward=multistep_process, gsm8k_process or prm) or remove "
            "reward.credit") in str(err.value).splitlines()
    with pytest.raises(ConfigError, match=r"reward.credit \('mean'\) must be sum or min"):
        validate(compose("train", ["reward=multistep_process", "data=multistep", "reward.credit=mean"]))
    validate(compose("train", ["reward=multistep_process", "data=multistep", "reward.credit=min"]))


def test_at_end_gives_every_token_the_same_sum():
    # reward.scorer.at_end=true: the same step scores, every one on the EOS: each token of a completion gets the sum
    # of its normalized steps (S: 1.731852 - 3 x 0.577284 = 0; W: 1.731852 - 3 x 0.577284 = 0 too, as both have one
    # +1 and three -1), the value its first token gets under the default placement
    cfg = OmegaConf.load(CONF_DIR / "reward" / "multistep_process.yaml")
    texts = ["6 - 3 = 3", "6 - 3 = 3\n3 + 8 = 12\n12 - 7 = 5", EX["solution"]]
    columns = {"answer": ["4"] * 3, "solution": [EX["solution"]] * 3, "truncated": [False] * 3}
    placed = instantiate(cfg)(["q"] * 3, texts, columns)
    cfg.scorer.at_end = True
    at_end = instantiate(cfg)(["q"] * 3, texts, columns)
    assert [[r for _, r in s] for s in at_end.steps] == [[r for _, r in s] for s in placed.steps]
    assert all(end == len(t) + 1 for t, s in zip(texts, at_end.steps) for end, _ in s)
    adv, _ = group_advantages(texts, EX)
    rows = [TOK.encode(t, add_special_tokens=False) + [TOK.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [TOK.eos_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    rollout = Rollout(torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long), ids, mask, texts,
                      [False] * 3)
    flat = advantages(token_rewards(at_end, rollout, TOK), 3, "group", "population")
    for i, t in enumerate(texts):
        assert flat[i, :len(t) + 1].tolist() == pytest.approx([adv[i, 0].item()] * (len(t) + 1), abs=1e-5)
