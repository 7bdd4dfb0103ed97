"""What `grpo train`, `grpo eval` and `grpo sample` build alike, assembled one way: `assemble(cfg, purpose)`.

    parts = assemble(cfg, "eval")               # data, env, tool format, reward, columns checked, engine chosen
    policy, tokenizer = ...                     # the command's own model (train: the policy; eval, sample: inference)
    parts.template(tokenizer)                   # the data's chat template on the model's tokenizer
    sampler, section = parts.start(policy, job) # the engine built, wrapped for episodes, started, its line printed

Everything here is built before the model loads, in the order that stops a bad config soonest: the data (a bad
path or column), the environment and its tool format (tools that do not resolve, a format that does not fit the
chat template), the reward (a function that does not import; a reward model loads last), then the columns the
reward reads checked against the data's first row. The purpose decides what differs: train scores with its reward
schedule (a fixed reward, or iterative RL) and checks its dynamic-sampling filter beside the columns, on the
training stream's first row; eval and sample score with the built reward, checked on the held-out split's; a
prompt given on `grpo sample`'s command line has no columns and is not scored, so nothing is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig

from grpo_cli.env import ToolFormat, from_config
from grpo_cli.groups import GroupFilter
from grpo_cli.instantiate import build
from grpo_cli.iterative import IterativeRL, RewardModelTrainer
from grpo_cli.reward_schedule import FixedReward, RewardSchedule
from grpo_cli.rewards.call import check_columns, column_example
from grpo_cli.rollout import use_chat_template
from grpo_cli.rollout.engine import Choice, choose, say
from grpo_cli.rollout.episodes import early_format, with_env
from grpo_cli.rollout.sizing import Job

# train: a run's steps; eval: held-out problems scored; sample: held-out problems shown with their rewards;
# prompt: `grpo sample sample.prompt=...`, a prompt of the command line, shown unscored
Purpose = Literal["train", "eval", "sample", "prompt"]


@dataclass(frozen=True)
class Components:
    """What a command builds before its model loads; `start` builds and starts the engine once it has."""

    data: Any                         # the built data task: its splits and its chat template
    reward: Any                       # eval, sample: the built reward; train: the run's RewardSchedule
    env: Any                          # env=tools or class: the built environment (episodes); None: plain completions
    tool_format: ToolFormat | None    # the tool format, chosen before the model loads (None: at the first episode)
    choice: Choice                    # the sampler section that samples, and why (the engine's console line)
    keep: GroupFilter | None = None   # train: which sampled groups a step trains on (dynamic sampling); else None

    def template(self, tokenizer) -> None:
        """The data's chat template (and its variables) on `tokenizer`, as the engine and the rewards render."""
        use_chat_template(tokenizer, self.data.chat_template, self.data.chat_template_kwargs)

    def start(self, policy, job: Job) -> tuple[Any, DictConfig]:
        """(the started sampler, the sampler section that samples: a fallback's where the chosen engine cannot
        serve the model). The sampler samples episodes when the command has an environment; started before the
        first rollout and sized for `job`, it prints the one line that says which engine samples and why."""
        sampler = with_env(build(self.choice.section), self.env, self.tool_format)
        section = sampler.start(policy, self.choice.section, job)
        say(sampler, self.choice.why)
        return sampler, section


def assemble(cfg: DictConfig, purpose: Purpose, *, run_dir: Path | None = None, why: str | None = None
             ) -> Components:
    """The components a command of `purpose` shares with the others, built from its validated config.

    `why`: train chose its engine before its checks (`engine.choose`, with the refusals only a run has), so its
    config's sampler section is the one that samples and `why` says why; None (eval, sample): chosen here.
    `run_dir`: train's run folder, where iterative RL keeps its reward models."""
    data = build(cfg.data)
    env = from_config(cfg)  # env=tools or class: multi-turn episodes (the tools resolve here, before the model)
    tool_format = early_format(env, cfg.model, data)  # and the tool format fits the chat template
    keep = None
    if purpose == "train":
        algo = cfg.algo
        reward = reward_schedule(cfg, run_dir, data)
        keep = GroupFilter(algo.dynamic_sampling, algo.filter_metric, algo.max_generation_batches)
        reward.check(column_example(env, data.train[0]), keep)  # and the filter's metric is one the reward reports
    else:
        reward = build(cfg.reward)
        if purpose != "prompt":
            check_columns(reward, column_example(env, data.heldout[0]))
    # sampler=auto: vLLM when installed and usable (a checkpoint's own sampler as it is)
    choice = Choice(cfg.sampler, why) if why is not None else choose(cfg.sampler)
    return Components(data, reward, env, tool_format, choice, keep)


def reward_schedule(cfg: DictConfig, run_dir: Path, data) -> RewardSchedule:
    """A run's reward: `reward` for every step, or iterative RL's retrained reward models."""
    if not cfg.iterative.iterations:
        return FixedReward(build(cfg.reward))
    temperature = cfg.iterative.temperature
    return IterativeRL(
        cfg.iterative, cfg.rm, run_dir=run_dir, seed=cfg.trainer.seed, labeler=build(cfg.labeler),
        problems=data.train, sampler=build(cfg.sampler, **({"temperature": temperature} if temperature else {})),
        reward_model=lambda path: build(cfg.reward, name_or_path=path),
        trainer=RewardModelTrainer(cfg.rm, cfg.model.loader, cfg.model.dtype),
        start=cfg.reward.get("name_or_path"))
