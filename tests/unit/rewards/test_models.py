"""Reward models (ORM, PRM) on tiny random checkpoints, and every conf/reward option instantiated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from grpo_cli.errors import ConfigError
from grpo_cli.rewards import RewardResult, split_steps
from grpo_cli.rewards.models import SequenceClassifierReward, TokenClassifierPRM
from tests.helpers import REPO

REWARD_CONF = REPO / "conf" / "reward"


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory) -> dict[str, Path]:
    """Folders holding a 1-layer random Llama with a 1-logit sequence head (orm) and a 2-label token
    head (prm), each with the character tokenizer, as save_pretrained writes them."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaForTokenClassification

    from grpo_cli.policy import char_tokenizer

    tokenizer = char_tokenizer()
    sizes = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                 eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    root = tmp_path_factory.mktemp("reward_models")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = {"orm": LlamaForSequenceClassification(LlamaConfig(num_labels=1, **sizes)),
                 "prm": LlamaForTokenClassification(LlamaConfig(num_labels=2, **sizes))}
    for name, model in heads.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {name: root / name for name in heads}


PROMPTS = ["Q:", "Q:", "Q:"]
COMPLETIONS = ["1 + 1 = 2\n#### 2", "2 + 2 = 5\n#### 5", "no steps here"]


def test_orm_loads_lazily_and_scores(reward_models):
    orm = SequenceClassifierReward(str(reward_models["orm"]), batch_size=1, device="cpu")
    assert orm.model is None  # building the reward costs nothing until it scores
    one_by_one = orm(PROMPTS, COMPLETIONS)
    assert orm.model is not None
    assert len(one_by_one) == 3 and all(0.0 < s < 1.0 for s in one_by_one)  # sigmoid of one logit
    # right padding in a batch of 3 must not change any score
    orm.batch_size = 3
    assert orm(PROMPTS, COMPLETIONS) == pytest.approx(one_by_one, abs=1e-5)
    # raw logits: sigmoid^-1 of the scores
    orm.sigmoid = False
    assert torch.sigmoid(torch.tensor(orm(PROMPTS, COMPLETIONS))).tolist() == pytest.approx(one_by_one, abs=1e-5)


def test_orm_takes_a_model_object(tiny):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    _, tokenizer = tiny
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=tokenizer.pad_token_id)).eval()
    good = SequenceClassifierReward(model=model, tokenizer=tokenizer, label=1)(PROMPTS, COMPLETIONS)
    bad = SequenceClassifierReward(model=model, tokenizer=tokenizer, label=0)(PROMPTS, COMPLETIONS)
    # two labels: softmax probabilities of label 1 and label 0 add up to 1
    assert [g + b for g, b in zip(good, bad)] == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="label 5 is out of range"):
        SequenceClassifierReward(model=model, tokenizer=tokenizer, label=5)(PROMPTS, COMPLETIONS)


def test_prm_scores_each_step_at_its_last_character(reward_models):
    prm = TokenClassifierPRM(str(reward_models["prm"]), batch_size=2, device="cpu")
    steps = prm(PROMPTS, COMPLETIONS)
    # char_ends are split_steps' ends: "1 + 1 = 2" ends at 9, "#### 2" at 16; one line -> one step
    assert [[end for end, _ in s] for s in steps] == [[9, 16], [9, 16], [13]]
    assert [[end for _, end in split_steps(c)] for c in COMPLETIONS] == [[9, 16], [9, 16], [13]]
    # by hand: one character per token and no BOS, so "Q:" is tokens 0-1 and the completion's
    # character c is token 2 + c; step 1 ends at char 9 -> its last char 8 -> token 10
    model, tokenizer = prm.model, prm.tokenizer
    ids = tokenizer(PROMPTS[0] + COMPLETIONS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[0], dim=-1)[:, 1]  # [T] P(label 1)
    assert [r for _, r in steps[0]] == pytest.approx([probs[10].item(), probs[17].item()], abs=1e-5)
    # batch size does not change the scores
    prm.batch_size = 1
    for a, b in zip(prm(PROMPTS, COMPLETIONS), steps):
        assert [r for _, r in a] == pytest.approx([r for _, r in b], abs=1e-5)


def test_orm_config_scores_with_the_model_alone(reward_models):
    reward = instantiate(OmegaConf.merge(OmegaConf.load(REWARD_CONF / "orm.yaml"),
                                         {"name_or_path": str(reward_models["orm"]), "device": "cpu"}))
    result = reward(PROMPTS, COMPLETIONS, {"answer": ["2", "4", "4"]})
    # accuracy is a metric (weight 0): the reward is the ORM's score, whatever accuracy says
    assert result.rewards == pytest.approx(result.per_function["orm"])
    assert result.per_function["accuracy"] == [1.0, 0.0, 0.0]


def test_reward_model_needs_a_model():
    with pytest.raises(ConfigError, match="name_or_path"):
        SequenceClassifierReward()
    with pytest.raises(ConfigError, match="name_or_path"):
        TokenClassifierPRM()
    with pytest.raises(ConfigError, match="template"):
        SequenceClassifierReward("x", template="{prompt}")


@pytest.mark.parametrize("path", sorted(REWARD_CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_reward_config_instantiates_and_scores(path, reward_models):
    cfg = OmegaConf.load(path)
    # the model-based options leave name_or_path required (???); point it at the tiny checkpoints
    if path.stem in reward_models:
        cfg.name_or_path = str(reward_models[path.stem])
        cfg.device = "cpu"
    if path.stem == "custom":  # the user names their functions (tests/integration/test_own_task.py); a built-in here
        cfg.funcs = ["accuracy"]
    assert not OmegaConf.missing_keys(cfg)
    reward = instantiate(cfg)
    columns = {"answer": ["2", "4", "4"], "completion_length": [16, 16, 13], "truncated": [False, False, True],
               # the reference chain multistep_process judges lines against
               "solution": ["1 + 1 = 2", "2 + 2 = 4", "2 + 2 = 4"]}
    result = reward(PROMPTS, COMPLETIONS, columns)
    assert isinstance(result, RewardResult)
    assert len(result.rewards) == 3 and result.failures == 0
    assert all(r is None or isinstance(r, float) for r in result.rewards)
    if "accuracy" in result.per_function:
        # "#### 2" vs 2 right; "#### 5" vs 4 wrong; no answer line, no number vs 4 wrong
        assert result.per_function["accuracy"] == [1.0, 0.0, 0.0]
    if result.steps is not None:
        # a line step and the answer's step each (prm: a step per line); "no steps here" has the answer's step
        # alone, and under the chain judge also its one reference slot never written
        assert [len(s) for s in result.steps] == ([2, 2, 2] if path.stem == "multistep_process" else [2, 2, 1])


def test_every_reward_option_is_tested():
    assert {p.stem for p in REWARD_CONF.glob("*.yaml")} >= {"arithmetic", "gsm8k", "gsm8k_process", "orm", "prm"}
