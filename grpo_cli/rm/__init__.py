"""Training reward models: labeled rows, labelers, a replay buffer, and the ORM/PRM trainer.

    rows = OutcomeLabeler()(samples)                           # or MonteCarloLabeler / VerifierLabeler
    train, heldout = split_heldout(rows, 0.2, seed=0)
    mix, info = ReplayBuffer(folder, share=0.1).mix(iteration, train)
    model, tokenizer = new_classifier("outcome", base, tokenizer)   # or load_classifier(folder, kind)
    model = add_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    train_classifier(model, tokenizer, mix, kind="outcome", ...)
    save_reward_model(model.merge_and_unload(), tokenizer, folder)   # reward=orm reward.name_or_path=folder

A labeled row is one JSON object (one JSONL line):

    {"prompt": "What is 3 + 4?", "completion": "7", "label": 1.0}                         # outcome (ORM)
    {"prompt": "...", "completion": "3 + 4 = 7\\n#### 7", "steps": [[9, 1.0], [16, 1.0]]}   # process (PRM)

`prompt` is the text the reward model reads before the completion: the problem's question, as
`grpo_cli.rewards.score` hands it to reward functions (not the chat-templated prompt). Labels are in
[0, 1] (soft labels train as soft targets). A step is `[char_end, label]`, char_end the exclusive
end of the step in the completion, as `split_steps` and `ProcessReward` give it. Other keys
(`answer`, `split`, ...) are kept and ignored.

The models are what `grpo_cli.rewards.models` loads: an ORM is an AutoModelForSequenceClassification
with one logit (score = sigmoid, read at the last token), a PRM an AutoModelForTokenClassification
with one logit per token (a step's score is read at the token holding its last character, the token
`models.TokenClassifierPRM` reads). Both are trained with binary cross-entropy, through a LoRA
adapter on the base LM plus the whole new head, and merged before saving, so the folder is a plain
transformers model (safetensors) with its tokenizer.

Labelers (the `labeler` config group) turn policy samples into rows:
  - `OutcomeLabeler`: 1 when the completion's final answer matches the reference
    (`grpo_cli.rewards.outcome.accuracy`), else 0.
  - `MonteCarloLabeler`: Math-Shepherd (Wang et al. 2023, arXiv 2312.08935): from the prefix that
    ends each step, k continuations by the policy; hard estimate = 1 if any reaches the right
    answer, soft = the fraction that do. Departure: the last step of a finished (not truncated)
    completion is labeled by the completion's own answer, with no continuations (there is nothing
    left to continue); Math-Shepherd's final step is checked against the answer the same way.
  - `VerifierLabeler`: the rule-based step verifier (`verify_steps`): a step rewarded > 0 is 1,
    < 0 is 0, and a step with reward 0 (no checkable claim, or right arithmetic cancelled by a wrong
    final answer) gets no label.

Replay (DeepSeekMath §4.2 / Algorithm 1: "continuously train the reward model with a replay mechanism
that incorporates 10% of historical data"): `ReplayBuffer` keeps each iteration's new rows in
`iteration_NNN.jsonl` and mixes a training set as the new rows plus r rows drawn, seeded, without
replacement, from the rows of earlier iterations only, where r is the whole number nearest to
n_new * share / (1 - share), halves rounded up, so that r / (n_new + r) is as close to `share` as a
whole r allows (n_new = 90, share 0.1 -> r = 10, exactly 10%; n_new = 100 -> 11.1 -> 11, 9.9%).
When earlier iterations hold fewer rows than r, all of them are used and the share is lower (the
mix reports the share it reached). share = 1 trains on all earlier rows and none of the new ones.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer

from grpo_cli import files
from grpo_cli.errors import ConfigError, DataError
from grpo_cli.instantiate import build
from grpo_cli.rewards.models import check_classifier
from grpo_cli.rewards.outcome import accuracy
from grpo_cli.rewards.steps import split_steps, verify_steps
from grpo_cli.rollout import render_prompts

KINDS = ("outcome", "process")
# the transformers auto class each kind of reward model is saved as and loaded with
AUTO_CLASS = {"outcome": "AutoModelForSequenceClassification", "process": "AutoModelForTokenClassification"}

Row = dict[str, Any]


# ---- labeled rows ------------------------------------------------------------------------------

def _label_ok(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1


def row_kind(row: Row, where: str) -> str:
    """`outcome` or `process` for one row, checked; DataError (naming `where` and the fix) if bad."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with prompt, completion and label or steps")
    for key in ("prompt", "completion"):
        if not isinstance(row.get(key), str):
            raise DataError(f"{where}: {key!r} is missing or not a string; every row needs \"prompt\" and "
                            f"\"completion\" text")
    has_label, has_steps = row.get("label") is not None, row.get("steps") is not None
    if has_label and has_steps:
        raise DataError(f"{where}: both \"label\" and \"steps\"; a row is an outcome row (label) or a process "
                        f"row (steps): drop one of them")
    if not has_label and not has_steps:
        raise DataError(f"{where}: no label; an outcome row needs \"label\" (0..1), a process row \"steps\" "
                        f"([[char_end, label], ...]): add it or drop the line")
    if has_label:
        if not _label_ok(row["label"]):
            raise DataError(f"{where}: label {row['label']!r} must be a number in [0, 1]; fix or drop the line")
        return "outcome"
    steps, n = row["steps"], len(row["completion"])
    if not isinstance(steps, list) or not steps:
        raise DataError(f"{where}: \"steps\" must be a non-empty list of [char_end, label] pairs; "
                        f"fix or drop the line")
    last = 0
    for step in steps:
        if not (isinstance(step, (list, tuple)) and len(step) == 2 and isinstance(step[0], int)
                and not isinstance(step[0], bool)):
            raise DataError(f"{where}: step {step!r} must be a pair [char_end, label] with an integer char_end")
        end, label = step
        if not 0 < end <= n:
            raise DataError(f"{where}: step end {end} is outside the completion ({n} characters); a step end is "
                            f"the exclusive character offset of the step's end, in 1..{n}")
        if end <= last:
            raise DataError(f"{where}: step ends must increase ({last} then {end}); sort the steps by char_end")
        if not _label_ok(label):
            raise DataError(f"{where}: step label {label!r} must be a number in [0, 1]; fix or drop the line")
        last = end
    return "process"


def check_rows(rows: list[Row], source: str = "rows") -> str:
    """The kind shared by every row; DataError at the first bad row (1-based, as a file line)."""
    if not rows:
        raise DataError(f"{source} holds no labeled rows; label some samples first")
    kind = None
    for i, row in enumerate(rows, 1):
        this = row_kind(row, f"{source} line {i}")
        if kind is None:
            kind = this
        elif this != kind:
            raise DataError(f"{source} line {i} is a {this} row but line 1 is a {kind} row; one reward model "
                            f"trains on one kind: split the file")
    return kind


def read_labeled(path: str | Path) -> tuple[list[Row], str]:
    """(rows, kind) of a labeled JSONL; DataError naming the file and line on a bad row."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"rm.labeled={path} is not a file; pass a JSONL of labeled rows "
                          f"(their format: grpo_cli/rm/)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {i} is not JSON ({err.msg}); fix or drop the line") from None
    return rows, check_rows(rows, str(path))


def write_jsonl(path: str | Path, rows: list[Row]) -> None:
    """Write rows atomically (a temporary file renamed into place)."""
    files.write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def split_heldout(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held-out) rows, split by prompt so no held-out problem is trained on.

    round(fraction * P) of the P distinct prompts (halves up) are held out, seeded; at least one
    when fraction > 0 and at most P - 1, so neither side is empty when P >= 2.
    """
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    count = math.floor(Fraction(str(fraction)) * len(prompts) + Fraction(1, 2))
    if fraction > 0:
        count = min(max(count, 1), len(prompts) - 1)
    held = set(random.Random(seed).sample(prompts, count)) if count > 0 else set()
    return [r for r in rows if r["prompt"] not in held], [r for r in rows if r["prompt"] in held]


# ---- replay ------------------------------------------------------------------------------------

def replay_count(n_new: int, share: float) -> int:
    """Earlier rows to add to n_new new ones: round(n_new * share / (1 - share)), halves up.

    Exact (the share is read as the decimal it is written as), so 0.1 of a 90-row mix is 10, not 9.
    """
    s = Fraction(str(share))
    if s >= 1:
        raise ValueError("share 1 has no finite count: the mix is all earlier rows")
    return math.floor(Fraction(n_new) * s / (1 - s) + Fraction(1, 2))


def check_share(share: Any, key: str = "rm.replay.share") -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"{key} ({share!r}) must be in [0, 1]: the share of earlier iterations' rows in each "
                          f"reward-model training mix; set {key}=0.1")
    return float(share)


class ReplayBuffer:
    """Labeled rows of each iteration in `folder/iteration_NNN.jsonl`, and the replay mix.

    The files are the state: `mix(i, new)` reads only iterations < i and is a pure function of
    (seed, i, those files), so a resumed run draws the same mix; `add(i, rows)` rewrites iteration
    i's file. `state_dict()` records the settings and the row count of each iteration for a
    checkpoint; `load_state_dict` checks the folder still holds exactly those rows.
    """

    PATTERN = "iteration_{:03d}.jsonl"

    def __init__(self, folder: str | Path, share: float = 0.1, seed: int = 0):
        self.folder = Path(folder)
        self.share = check_share(share)
        self.seed = seed

    def path(self, iteration: int) -> Path:
        return self.folder / self.PATTERN.format(iteration)

    def iterations(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = [p.name[len("iteration_"):-len(".jsonl")] for p in self.folder.glob("iteration_*.jsonl")]
        return sorted(int(i) for i in found if i.isdigit())

    def next_iteration(self) -> int:
        done = self.iterations()
        return done[-1] + 1 if done else 0

    def rows(self, iteration: int) -> list[Row]:
        path = self.path(iteration)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def add(self, iteration: int, rows: list[Row]) -> None:
        """Store iteration `iteration`'s new rows (replacing any earlier file of that iteration)."""
        write_jsonl(self.path(iteration), [{**r, "iteration": iteration} for r in rows])

    def mix(self, iteration: int, new: list[Row]) -> tuple[list[Row], dict]:
        """(new rows + replayed rows of iterations < `iteration`, counts). Replayed rows keep their
        `iteration` field, so a caller can see where each came from."""
        earlier = [r for i in self.iterations() if i < iteration for r in self.rows(i)]
        if self.share >= 1:
            mixed, want = list(earlier), len(earlier)
            new = []
        else:
            want = replay_count(len(new), self.share)
            rng = random.Random(self.seed * 1_000_003 + iteration)
            mixed = rng.sample(earlier, min(want, len(earlier)))
        replayed = len(mixed)
        mixed = list(new) + mixed
        if mixed:
            check_rows(mixed, f"replay mix of iteration {iteration}")
        info = {"iteration": iteration, "new": len(new), "replay": replayed, "replay_wanted": want,
                "earlier_available": len(earlier), "share": replayed / len(mixed) if mixed else 0.0}
        return mixed, info

    def state_dict(self) -> dict:
        return {"folder": str(self.folder), "share": self.share, "seed": self.seed,
                "rows": {str(i): len(self.rows(i)) for i in self.iterations()}}

    def load_state_dict(self, state: dict) -> None:
        self.share, self.seed = check_share(state["share"]), int(state["seed"])
        for i, count in state["rows"].items():
            have = len(self.rows(int(i)))
            if have != count:
                raise ConfigError(f"replay buffer {self.folder}: iteration {i} holds {have} rows but the checkpoint "
                                  f"recorded {count}; restore {self.path(int(i)).name} or start a new run")


def _int_at_least(R, key: str, low: int, fix: int) -> None:
    value = R[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"rm.{key} ({value!r}) must be an integer >= {low}; set rm.{key}={fix}")


def check_settings(R) -> None:
    """The `rm` settings (conf/rm/default.yaml), each error naming the fix (before any model loads)."""
    for key, low, fix in (("num_problems", 1, 64), ("samples_per_problem", 1, 4), ("prompts_per_batch", 1, 16),
                          ("epochs", 1, 2), ("batch_size", 1, 8)):
        _int_at_least(R, key, low, fix)
    fraction = R.heldout_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise ConfigError(f"rm.heldout_fraction ({fraction!r}) must be in [0, 1): the share of prompts whose rows "
                          f"measure the model instead of training it; set rm.heldout_fraction=0.2")
    if isinstance(R.lr, bool) or not isinstance(R.lr, (int, float)) or R.lr <= 0:
        raise ConfigError(f"rm.lr ({R.lr!r}) must be > 0; set rm.lr=1e-4")
    if not isinstance(R.template, str) or R.template.count("{completion}") != 1 or "{prompt}" not in R.template:
        raise ConfigError(f"rm.template ({R.template!r}) must hold {{prompt}} and {{completion}} once each, as "
                          f"reward.template does where the model scores; set rm.template='{{prompt}}{{completion}}'")
    check_share(R.replay.share)


# ---- samples and labelers ----------------------------------------------------------------------

def pick_problems(dataset, count: int, seed: int) -> list[dict]:
    """`count` distinct problems of `dataset` (a task's train split), seeded; all of them if fewer."""
    indices = random.Random(seed).sample(range(len(dataset)), min(count, len(dataset)))
    return [dataset[i] for i in indices]


def draw_samples(policy, tokenizer, sampler, problems: list[dict], n: int, prompts_per_batch: int,
                 advance: Callable[[int], None] | None = None) -> list[dict]:
    """n completions per problem from `policy` (as it is: the caller picks adapter on/off).

    A sample is {"prompt": chat-templated prompt, "question", "answer", "completion", "truncated"}.
    """
    samples = []
    for first in range(0, len(problems), prompts_per_batch):
        batch = problems[first:first + prompts_per_batch]
        prompts = render_prompts(tokenizer, [p["messages"] for p in batch])
        out = sampler.generate(policy, tokenizer, prompts, n)
        for j, text in enumerate(out.texts):
            p = batch[j // n]
            samples.append({"prompt": prompts[j // n], "question": p["question"], "answer": p.get("answer"),
                            "completion": text, "truncated": out.truncated[j]})
        if advance:
            advance(len(batch))
    return samples


def _correct(completions: list[str], answer) -> list[float | None]:
    """1.0 / 0.0 per completion against one reference; None when there is no reference."""
    return accuracy([None] * len(completions), completions, [answer] * len(completions))


class OutcomeLabeler:
    """label = 1 when the final answer matches the reference, else 0 (rows without a reference dropped)."""

    kind = "outcome"

    def __call__(self, samples: list[dict], **_) -> list[Row]:
        rows = []
        for s in samples:
            label = _correct([s["completion"]], s["answer"])[0]
            if label is not None:
                rows.append({"prompt": s["question"], "completion": s["completion"], "label": label,
                             "answer": s["answer"]})
        return rows


class VerifierLabeler:
    """Step labels from the rule-based verifier: reward > 0 -> 1, < 0 -> 0, 0 -> no label."""

    kind = "process"

    def __init__(self, pattern: str | None = None):
        self.pattern = pattern

    def __call__(self, samples: list[dict], **_) -> list[Row]:
        rows = []
        for s in samples:
            scored = verify_steps(s["completion"], s["answer"], pattern=self.pattern)
            steps = [[end, 1.0 if r > 0 else 0.0] for end, r in scored if r != 0]
            if steps:
                rows.append({"prompt": s["question"], "completion": s["completion"], "steps": steps,
                             "answer": s["answer"]})
        return rows


class MonteCarloLabeler:
    """Math-Shepherd step labels: k continuations from the prefix ending each step.

    A step's label is 1 if any continuation reaches the reference answer (estimate=hard), or the
    fraction that do (estimate=soft). The last step of a completion that finished (EOS) is labeled
    by its own answer. Continuations use `sampler` on `policy` as it is called (adapter on or off
    is the caller's choice); prompt + prefix is generated from, and prefix + continuation is what
    the answer is read from.
    """

    kind = "process"

    def __init__(self, k: int = 8, estimate: str = "hard", pattern: str | None = None, prompts_per_batch: int = 16,
                 max_new_tokens: int | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"labeler.k ({k!r}) must be an integer >= 1 (continuations per step); set labeler.k=8")
        if estimate not in ("hard", "soft"):
            raise ConfigError(f"labeler.estimate ({estimate!r}) must be hard (any continuation right) or soft "
                              f"(the fraction right); set labeler.estimate=hard")
        if isinstance(prompts_per_batch, bool) or not isinstance(prompts_per_batch, int) or prompts_per_batch < 1:
            raise ConfigError(f"labeler.prompts_per_batch ({prompts_per_batch!r}) must be an integer >= 1; "
                              f"set labeler.prompts_per_batch=16")
        self.k, self.estimate, self.pattern = k, estimate, pattern
        self.prompts_per_batch, self.max_new_tokens = prompts_per_batch, max_new_tokens

    def jobs(self, samples: list[dict]) -> tuple[list[list[float | None]], list[tuple[int, int, str]]]:
        """(labels with None where continuations are needed, [(sample, step, prefix), ...] to continue)."""
        labels, jobs = [], []
        for i, s in enumerate(samples):
            spans = split_steps(s["completion"], self.pattern)
            mine: list[float | None] = []
            for j, (_, end) in enumerate(spans):
                if j == len(spans) - 1 and not s["truncated"]:
                    mine.append(_correct([s["completion"]], s["answer"])[0])
                else:
                    mine.append(None)
                    jobs.append((i, j, s["completion"][:end]))
            labels.append(mine)
        return labels, jobs

    def estimate_label(self, prefix: str, continuations: list[str], answer) -> float | None:
        hits = _correct([prefix + c for c in continuations], answer)
        if any(h is None for h in hits):
            return None
        right = sum(hits)
        return right / len(hits) if self.estimate == "soft" else float(right > 0)

    def __call__(self, samples: list[dict], *, policy=None, tokenizer=None, sampler=None,
                 advance: Callable[[int], None] | None = None, **_) -> list[Row]:
        labels, jobs = self.jobs(samples)
        if jobs and sampler is None:
            raise ConfigError("labeler=mc needs a policy to continue from each step; sample from a policy "
                              "(drop rm.labeled) or use labeler=verifier")
        for first in range(0, len(jobs), self.prompts_per_batch):
            chunk = jobs[first:first + self.prompts_per_batch]
            prompts = [samples[i]["prompt"] + prefix for i, _, prefix in chunk]
            out = sampler.generate(policy, tokenizer, prompts, self.k, max_new_tokens=self.max_new_tokens)
            for c, (i, j, prefix) in enumerate(chunk):
                continuations = out.texts[c * self.k:(c + 1) * self.k]
                labels[i][j] = self.estimate_label(prefix, continuations, samples[i]["answer"])
            if advance:
                advance(len(chunk))
        rows = []
        for s, mine in zip(samples, labels):
            spans = split_steps(s["completion"], self.pattern)
            steps = [[end, label] for (_, end), label in zip(spans, mine) if label is not None]
            if steps:
                rows.append({"prompt": s["question"], "completion": s["completion"], "steps": steps,
                             "answer": s["answer"]})
        return rows


# ---- the model ---------------------------------------------------------------------------------

def _auto_class(kind: str):
    if kind not in KINDS:
        raise ConfigError(f"reward-model kind {kind!r} is unknown; use outcome or process")
    return getattr(transformers, AUTO_CLASS[kind])


def new_classifier(kind: str, base, tokenizer, seed: int = 0):
    """A one-logit classifier (`kind` decides sequence vs token head) on `base`'s backbone weights.

    The backbone is copied from the causal LM `base`; the head is new, initialised with `seed`.
    """
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    config.architectures = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _auto_class(kind).from_config(config)
    backbone = getattr(model, model.base_model_prefix)
    backbone.load_state_dict(getattr(base, base.base_model_prefix).state_dict())
    param = next(base.parameters())
    return model.to(device=param.device, dtype=param.dtype)


def load_classifier(path: str | Path, kind: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of a reward-model folder (`grpo rm` output), checked to be a `kind` model."""
    check_classifier(str(path), AUTO_CLASS[kind])
    model, info = _auto_class(kind).from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    if info.get("missing_keys"):
        raise ConfigError(f"{path} has no weights for {sorted(info['missing_keys'])[0]}: it is not a trained "
                          f"{AUTO_CLASS[kind]} checkpoint; pass a folder written by `grpo rm` or set rm.init=null")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def starting_classifier(init: str | Path | None, kind: str, loader, device: torch.device, dtype: torch.dtype,
                        seed: int = 0):
    """(model, tokenizer): the reward model in folder `init`, or a new head on the base LM that the
    `model.loader` config node `loader` builds (DeepSeekMath starts reward models from the policy's base)."""
    if init:
        return load_classifier(init, kind, device, dtype)
    base, tokenizer = build(loader, dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = new_classifier(kind, base.to(device), tokenizer, seed=seed)
    del base
    return model, tokenizer


def head_names(model) -> list[str]:
    """The classification head's module names: children with weights beside the backbone."""
    return [name for name, child in model.named_children()
            if name != model.base_model_prefix and any(True for _ in child.parameters())]


def add_lora(model, r: int, alpha: int, dropout: float, target_modules):
    """A peft LoRA adapter on the backbone; the head (new, so it cannot be low-rank) trains in full."""
    heads = head_names(model)
    task = "SEQ_CLS" if "SequenceClassification" in type(model).__name__ else "TOKEN_CLS"
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        exclude_modules=heads, modules_to_save=heads, task_type=task)
    return get_peft_model(model, config)


def save_reward_model(model, tokenizer, folder: str | Path, record: dict | None = None) -> Path:
    """Write a (merged, plain transformers) reward model + tokenizer atomically (files.folder: the old
    folder is deleted only once the new one is in place); `record` -> rm.json."""
    folder = Path(folder)
    model.config.pad_token_id = tokenizer.pad_token_id
    with files.folder(folder) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if record is not None:
            (tmp / "rm.json").write_text(json.dumps(record, indent=1))
    return folder


# ---- batches, training, scoring ----------------------------------------------------------------

def _texts(rows: list[Row], template: str) -> tuple[list[str], list[int]]:
    """Model inputs and the character where each completion starts, as `rewards.models` builds them."""
    head = template.split("{completion}")[0]
    return ([template.format(prompt=r["prompt"], completion=r["completion"]) for r in rows],
            [len(head.format(prompt=r["prompt"])) for r in rows])


def encode(tokenizer, rows: list[Row], kind: str, template: str, device) -> tuple[dict, tuple, torch.Tensor]:
    """(model inputs, where to read logits, targets) for a batch of rows, right-padded.

    outcome: one target per row, read at the last token (the sequence head's own choice).
    process: one target per labeled step, read at (row, token holding the step's last character),
    the token `TokenClassifierPRM` reads (the first whose offset end passes that character).
    """
    texts, starts = _texts(rows, template)
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                    return_offsets_mapping=kind == "process")
    inputs = {k: enc[k].to(device) for k in ("input_ids", "attention_mask")}
    if kind == "outcome":
        return inputs, (), torch.tensor([float(r["label"]) for r in rows])
    at_rows, at_tokens, targets = [], [], []
    for b, row in enumerate(rows):
        token_ends = [end for _, end in enc["offset_mapping"][b].tolist()]  # pads: (0, 0)
        for char_end, label in row["steps"]:
            last = starts[b] + char_end - 1
            t = next((t for t, end in enumerate(token_ends) if end > last), None)
            if t is not None:
                at_rows.append(b)
                at_tokens.append(t)
                targets.append(float(label))
    return inputs, (torch.tensor(at_rows, dtype=torch.long), torch.tensor(at_tokens, dtype=torch.long)), \
        torch.tensor(targets)


def logits_at(model, inputs: dict, where: tuple) -> torch.Tensor:
    """One logit per target: [B] for a sequence head, [S] (the labeled steps) for a token head."""
    logits = model(**inputs).logits.float()
    if logits.dim() == 2:  # [B, 1]
        return logits[:, 0]
    rows, tokens = where
    return logits[rows.to(logits.device), tokens.to(logits.device), 0]  # [B, T, 1] -> [S]


def train_classifier(model, tokenizer, rows: list[Row], *, kind: str, template: str, epochs: int, batch_size: int,
                     lr: float, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0, seed: int = 0,
                     advance: Callable[[int, float], None] | None = None) -> list[float]:
    """AdamW on binary cross-entropy over the trainable parameters; returns the loss of each batch.

    Rows are reshuffled every epoch (seeded); a batch's loss is the mean over its targets (rows for
    an ORM, labeled steps for a PRM). `advance(rows_done, loss)` is called after each batch.
    """
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(rows), generator=generator).tolist()
        for first in range(0, len(order), batch_size):
            batch = [rows[i] for i in order[first:first + batch_size]]
            inputs, where, targets = encode(tokenizer, batch, kind, template, device)
            if targets.numel() == 0:
                continue
            logits = logits_at(model, inputs, where)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets.to(logits.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            if advance:
                advance(len(batch), loss.item())
    model.eval()
    return losses


@torch.no_grad()
def predict(model, tokenizer, rows: list[Row], *, kind: str, template: str,
            batch_size: int = 8) -> tuple[list[float], list[float]]:
    """(scores in (0, 1), labels): one per outcome row or per labeled step, in row order."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    labels: list[float] = []
    for first in range(0, len(rows), batch_size):
        inputs, where, targets = encode(tokenizer, rows[first:first + batch_size], kind, template, device)
        if targets.numel():
            scores += torch.sigmoid(logits_at(model, inputs, where)).tolist()
            labels += targets.tolist()
    model.train(was_training)
    return scores, labels


def binary_auc(scores: list[float], positive: list[bool]) -> float | None:
    """ROC AUC = P(score of a random positive > score of a random negative), ties counting 1/2
    (Mann-Whitney U from average ranks); None when one class is absent."""
    n_pos = sum(positive)
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # tied scores share the average of their 1-based ranks
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, p in zip(ranks, positive) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def classification_metrics(scores: list[float], labels: list[float]) -> dict:
    """Accuracy at 0.5, AUC and BCE of scores against labels; a label >= 0.5 counts as positive."""
    positive = [y >= 0.5 for y in labels]
    n = len(labels)
    eps = 1e-7
    bce = -sum(y * math.log(max(s, eps)) + (1 - y) * math.log(max(1 - s, eps)) for s, y in zip(scores, labels))
    return {"labels": n, "positives": sum(positive),
            "accuracy": sum((s >= 0.5) == p for s, p in zip(scores, positive)) / n if n else None,
            "auc": binary_auc(scores, positive), "loss": bce / n if n else None,
            "mean_score": sum(scores) / n if n else None}


def evaluate(model, tokenizer, rows: list[Row], *, kind: str, template: str, batch_size: int = 8) -> dict:
    """Accuracy, AUC, BCE and mean score of the reward model on labeled rows (per step for a PRM)."""
    scores, labels = predict(model, tokenizer, rows, kind=kind, template=template, batch_size=batch_size)
    return classification_metrics(scores, labels)


def retrain(model, tokenizer, train_rows: list[Row], heldout: list[Row], R, kind: str, seed: int | None = None,
            advance: Callable[[int, float], None] | None = None) -> tuple[Any, dict]:
    """(merged model, report): score `heldout` with `model`, train it on `train_rows` (LoRA on the
    backbone + the whole head, settings `R` = the `rm` config section), merge, score `heldout` again.

    Shared by `grpo rm` and the iterations of `grpo train`. The report holds `heldout_before`,
    `heldout_after` (`evaluate`'s metrics; None without held-out rows) and the first and last batch loss.
    """
    settings = dict(kind=kind, template=R.template, batch_size=R.batch_size)
    before = evaluate(model, tokenizer, heldout, **settings) if heldout else None
    model = add_lora(model, **R.lora)
    losses = train_classifier(model, tokenizer, train_rows, kind=kind, template=R.template, epochs=R.epochs,
                              batch_size=R.batch_size, lr=R.lr, weight_decay=R.weight_decay,
                              max_grad_norm=R.max_grad_norm, seed=R.seed if seed is None else seed, advance=advance)
    model = model.merge_and_unload()
    after = evaluate(model, tokenizer, heldout, **settings) if heldout else None
    return model, {"heldout_before": before, "heldout_after": after, "train_loss_first": losses[0] if losses else None,
                   "train_loss_last": losses[-1] if losses else None}
