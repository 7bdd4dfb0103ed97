"""grpo_cli/components.py and rewards/call.py's `score`: train, eval and sample assemble their data, environment,
reward and engine one way, and a rollout is scored with columns it derives itself."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.components import assemble
from grpo_cli.config import compose, validate
from grpo_cli.errors import ConfigError
from grpo_cli.rewards.call import score
from grpo_cli.rewards.result import RewardResult
from grpo_cli.rollout import Rollout
from tests.helpers.runs import write_jsonl


def rollout(ids: list[list[int]], truncated: list[bool]) -> Rollout:
    """Rows of token ids (each its own length), right-padded with 0."""
    width = max(len(r) for r in ids)
    completion = torch.tensor([r + [0] * (width - len(r)) for r in ids])  # [N, T]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    prompt = torch.ones(len(ids), 1, dtype=torch.long)
    return Rollout(prompt, prompt, completion, mask, [f"text {i}" for i in range(len(ids))], truncated)


def test_score_groups_rows_by_example_and_derives_the_rollouts_columns():
    seen = {}

    def reward(prompts, completions, columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return RewardResult([float(n) for n in columns["completion_length"]], {})

    examples = [{"messages": [], "question": "a?", "answer": "1"}, {"messages": [], "question": "b?", "answer": "2"}]
    out = score(reward, examples, rollout([[5], [6, 7], [8, 9, 10], [11]], [False, True, False, False]))
    # 4 rows under 2 examples: G = 2, rows 0-1 answer the first, rows 2-3 the second
    assert seen["prompts"] == ["a?", "a?", "b?", "b?"] and seen["answer"] == ["1", "1", "2", "2"]
    assert seen["completions"] == ["text 0", "text 1", "text 2", "text 3"]
    assert seen["completion_ids"] == [[5], [6, 7], [8, 9, 10], [11]]  # each row up to its mask's end
    assert seen["truncated"] == [False, True, False, False] and out.rewards == [1.0, 2.0, 3.0, 1.0]
    assert "messages" not in seen and "completion_messages" not in seen  # plain completions: no episode columns
    with pytest.raises(ValueError, match="3 completions do not group evenly under 2 examples"):
        score(reward, examples, rollout([[1], [2], [3]], [False] * 3))


def test_assemble_checks_the_columns_where_the_command_scores_and_not_for_a_free_prompt(tmp_path, monkeypatch):
    # held-out rows without an answer, and a reward (arithmetic: accuracy) that needs one
    write_jsonl(tmp_path / "open.jsonl", [{"prompt": f"say {i}"} for i in range(6)])
    monkeypatch.chdir(tmp_path)
    cfg = validate(compose("sample", ["model=tiny", "data=hf", "data.path=open.jsonl", "data.heldout_size=2",
                                      "reward=arithmetic", "sampler=default"]))
    for purpose in ("eval", "sample"):
        with pytest.raises(ConfigError, match="reward function 'accuracy' needs column 'answer'"):
            assemble(cfg, purpose)
    parts = assemble(cfg, "prompt")  # grpo sample sample.prompt=...: nothing is scored, nothing checked
    assert parts.env is None and parts.keep is None and parts.choice.why == "as configured"
    assert len(parts.data.heldout) == 2
    # train checks the training stream's rows, with its reward schedule and its dynamic-sampling filter; its engine
    # was chosen by the command, which says why
    train = validate(compose("train", ["model=tiny", "data=hf", "data.path=open.jsonl", "reward=arithmetic",
                                       "sampler=default"]))
    with pytest.raises(ConfigError, match="reward function 'accuracy' needs column 'answer'"):
        assemble(train, "train", run_dir=tmp_path, why="chosen")
    write_jsonl(tmp_path / "answered.jsonl", [{"prompt": f"say {i}", "answer": str(i)} for i in range(6)])
    train.data.path = "answered.jsonl"
    parts = assemble(train, "train", run_dir=tmp_path, why="chosen")
    assert parts.keep is not None and parts.choice.why == "chosen" and parts.choice.section == train.sampler
