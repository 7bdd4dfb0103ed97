"""`grpo sample`: print what a checkpoint (or the base model) writes, with its answer and reward.

    grpo sample checkpoint=outputs/train/DATE/TIME sample.prompt="What is 17 + 25?"
    grpo sample checkpoint=outputs/train/DATE/TIME 'sample.prompt="Is 3 < 4, yes or no?"'  # Hydra: quote , = < | [ ]
    grpo sample data=gsm8k data.path=train.jsonl sample.n=4 reward=gsm8k_process

With process rewards each step is highlighted green/red/grey by the sign of its step reward. With `env=tools` or
`class` (or a run trained with one) each completion is an episode, as in training, shown turn by turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig
from rich.panel import Panel
from rich.text import Text

from grpo_cli import checkpoint
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.checks import Check, Rule, is_int
from grpo_cli.components import assemble
from grpo_cli.errors import ConfigError
from grpo_cli.inference import inference_config, inference_policy, take_checkpoint
from grpo_cli.metrics.console import console
from grpo_cli.metrics.run_files import turns_text
from grpo_cli.policy import adapter_enabled
from grpo_cli.rewards.call import score
from grpo_cli.rewards.outcome import answers_match, extract_answer, reference_answer
from grpo_cli.rollout.episodes import env_closed, episode_fields
from grpo_cli.rollout.sizing import Job


@hydra_app("sample")
def main(cfg: DictConfig) -> None:
    run(cfg, command_line_overrides())


def run(cfg: DictConfig, overrides: list[str] = ()) -> list[dict]:
    sample_cfg = cfg.sample
    prompt = None if sample_cfg.prompt is None else str(sample_cfg.prompt)  # sample.prompt=17 is an int
    if prompt is not None and not prompt.strip():
        raise ConfigError(f"sample.prompt ({sample_cfg.prompt!r}) is empty; give the question, "
                          f"sample.prompt=\"What is 17 + 25?\", or drop it to sample held-out problems")
    # a run folder's best checkpoint (its evals recorded one), else its newest whose files read; RUN/best, RUN/last
    ckpt = take_checkpoint(cfg.checkpoint) if cfg.checkpoint else None
    cfg = inference_config(cfg, list(overrides), [ckpt], CHECKS)
    # the data (its prompts, and its chat template for a prompt of the command line too), the environment (or the
    # run's own: episodes, as train runs them) and the reward before the model: a bad path, column or reward
    # function stops here in seconds; a prompt of the command line has no columns to check
    parts = assemble(cfg, "sample" if prompt is None else "prompt")
    if prompt is not None:
        problems = [{"messages": [{"role": "user", "content": prompt}], "question": prompt}]
    else:
        problems = list(parts.data.heldout[: sample_cfg.num_prompts])
    policy, tokenizer = inference_policy(cfg)
    parts.template(tokenizer)
    if ckpt is not None:
        checkpoint.load_weights(policy, ckpt)
    # before the first prompt (a model vLLM cannot serve says so here), sized for this one call
    sampler, _ = parts.start(policy, Job(len(problems), sample_cfg.n))
    # the environment's instances closed when the episodes are scored, not when the collector finds them
    with adapter_enabled(policy, ckpt is not None), env_closed(sampler):
        rollout = sampler.sample(policy, tokenizer, problems, sample_cfg.n,
                                 generator=torch.Generator().manual_seed(sample_cfg.seed))
        # the data's problems, whose columns the reward reads; a free prompt has none
        result = score(parts.reward, problems, rollout) if prompt is None else None
    owners = [i for i in range(len(problems)) for _ in range(sample_cfg.n)]
    turns = episode_fields(rollout)  # episodes: each one's turns, calls and why it ended
    records = []
    for j, text in enumerate(rollout.texts):
        problem = problems[owners[j]]
        answer, reference = extract_answer(text), reference_answer(problem.get("answer"))
        record = {"question": problem["question"], "completion": text, "answer": answer,
                  "reference": problem.get("answer"), "truncated": rollout.truncated[j],
                  "correct": (answers_match(answer, reference)
                              if answer is not None and reference is not None else None),
                  "reward": result.rewards[j] if result else None,
                  "steps": result.steps[j] if result and result.steps is not None else None, **turns[j]}
        records.append(record)
        console.print(render(record, j % sample_cfg.n))
    if sample_cfg.output:
        Path(sample_cfg.output).parent.mkdir(parents=True, exist_ok=True)
        with open(sample_cfg.output, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        console.print(f"wrote {len(records)} completions to {sample_cfg.output}")
    return records


def render(record: dict, k: int) -> Panel:
    """A panel: the completion (steps coloured by their reward) and a line with answer, reward, verdict."""
    text = Text()
    start = 0
    for end, reward in record["steps"] or []:
        style = "green" if reward > 0 else "red" if reward < 0 else "dim"
        text.append(record["completion"][start:end], style=style)
        text.append(f" [{reward:+.2f}]", style=f"bold {style}")
        start = end
    text.append(record["completion"][start:])
    if "turns" in record:  # an episode: its turns one by one rather than its text, the tools' results marked
        text = turns_text(record["turns"])
    verdict = {True: "[green]correct", False: "[red]wrong", None: "[dim]no reference"}[record["correct"]]
    reward = f"{record['reward']:.3f}" if isinstance(record["reward"], (int, float)) else "-"
    title = f"sample {k}: {record['question'][:70]}"
    subtitle = (f"answer {record['answer']!s} · ref {record['reference']!s} · reward {reward} · {verdict}"
                + (" · truncated" if record["truncated"] else ""))
    return Panel(text, title=title, subtitle=subtitle, title_align="left", subtitle_align="left")

# ---- config checks: this module's settings, collected by config.validate --------------------------------

# the sample section's checks, which `run` hands to config.validate beside every library module's
CHECKS: list[Check] = [
    Rule("sample.seed", lambda v: is_int(v) and v >= 0, "must be an integer >= 0; set sample.seed=0"),
    Rule("sample.n", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set sample.n=4"),
    Rule("sample.num_prompts", lambda v: is_int(v) and v >= 1, "must be an integer >= 1; set sample.num_prompts=2"),
]
