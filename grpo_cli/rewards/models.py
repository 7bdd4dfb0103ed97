"""Learned reward models: an outcome reward model (ORM) and a process reward model (PRM).

DeepSeekMath trains both from its policy's base (arXiv 2402.03300, §4.1: the ORM scores the whole
completion, the PRM scores each step at the step's end token). Here both are Hugging Face models
given by hub id or local folder, loaded on their first call (so a config that builds one costs
nothing until it scores) and cached on the object:

  - `SequenceClassifierReward` (reward=orm, built by `outcome_reward_model`):
    `AutoModelForSequenceClassification` on prompt + completion; with one logit the score is
    sigmoid(logit) (or the raw logit), with several the softmax probability of label `label`.
  - `TokenClassifierPRM` (reward=prm, built by `process_reward_model`):
    `AutoModelForTokenClassification` on prompt + completion; a step's reward is read at the token
    holding the step's last character (char_end - 1), as the softmax probability of label `label`
    (sigmoid for one logit). We chose a token-classification
    head over a causal LM's "good step" token probability (Math-Shepherd's scheme, which also
    inserts a tag token after each step): it is what a PRM fine-tuned with transformers produces.
    The causal-LM scheme is not implemented.

Not done: sitting on the policy's own base weights as a second LoRA adapter (the paper's
arrangement) — the reward model is a separate network, loaded in full.

A folder that is not a classifier of the right kind (a causal LM, or an ORM given to reward=prm)
is a ConfigError, not a silently random head: `check_classifier` reads its config.json when the
scorer is built (local folders only, so a hub id still costs nothing until it scores), and loading
refuses a checkpoint without weights for the head. `grpo rm` (grpo_cli/rm/) trains
models of both kinds.

Both accept `model=` and `tokenizer=` objects directly (tests, or a model already in memory), run
in batches under torch.no_grad with right padding, and return scores in the calling convention of
`grpo_cli.rewards` (a list per completion; steps as (char_end, reward)). `outcome_reward_model` and
`process_reward_model` wrap them in the combiners (`combine`), which answer `names()` and `needs()`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import transformers
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig, AutoTokenizer

from grpo_cli.checks import Check, Rule
from grpo_cli.errors import ConfigError
from grpo_cli.policy import resolve_device, resolve_dtype
from grpo_cli.rewards.combine import OutcomeReward, ProcessReward
from grpo_cli.rewards.steps import split_steps

# what each kind is called in errors, and how to get one
_KIND = {"AutoModelForSequenceClassification": ("sequence-classification", "reward=orm", "grpo rm"),
         "AutoModelForTokenClassification": ("token-classification", "reward=prm", "grpo rm labeler=mc")}


def check_classifier(name_or_path: str, auto_class: str, trust_remote_code: bool = False,
                     revision: str | None = None) -> None:
    """ConfigError when the checkpoint's config names architectures and none is an `auto_class`
    head (nor maps one through auto_map); a config that cannot be read is left to the loader."""
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    except Exception:  # a missing folder or an unknown model type fails again, with its own message, when loading
        return
    archs = list(getattr(config, "architectures", None) or [])
    suffix = auto_class.replace("AutoModel", "")  # ForSequenceClassification / ForTokenClassification
    mapped = auto_class in (getattr(config, "auto_map", None) or {})
    if archs and not mapped and not any(a.endswith(suffix) for a in archs):
        what, option, command = _KIND[auto_class]
        raise ConfigError(f"{name_or_path} holds a {archs[0]}, not a {what} model, which {option} needs; "
                          f"train one with `{command}` and pass its RUN/model folder")


def max_input_tokens(model, tokenizer) -> int | None:
    """The longest input `model` reads: the smaller of its position table (`max_position_embeddings`) and
    the tokenizer's `model_max_length`; None when neither says."""
    limits = [getattr(model.config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None)]
    limits = [n for n in limits if isinstance(n, int) and 0 < n < 10**7]  # a tokenizer without a limit says 1e30
    return min(limits) if limits else None


class _HFScorer:
    """Lazy loading, input text and batching shared by the ORM and the PRM."""

    auto_class = ""
    # which end of an input longer than the model reads is cut (tokenizer truncation_side)
    truncation_side = "right"

    def __init__(self, name_or_path: str | None = None, *, model=None, tokenizer=None,
                 template: str = "{prompt}{completion}", label: int = 1, sigmoid: bool = True,
                 batch_size: int = 8, device: str = "auto", dtype: str = "auto",
                 trust_remote_code: bool = False, revision: str | None = None):
        if name_or_path is None and model is None:
            raise ConfigError(f"{type(self).__name__} needs a model: set name_or_path to a hub id or a "
                              f"local folder: reward.name_or_path=ORG/MODEL")
        if template.count("{completion}") != 1:
            raise ConfigError(f"reward model template {template!r} must contain {{completion}} exactly once")
        if batch_size < 1:
            raise ConfigError(f"reward model batch_size ({batch_size}) must be >= 1; set batch_size=8")
        self.name_or_path, self.template, self.label, self.sigmoid = name_or_path, template, label, sigmoid
        self.batch_size, self.device, self.dtype = batch_size, device, dtype
        self.trust_remote_code, self.revision = trust_remote_code, revision
        self.model, self.tokenizer = model, tokenizer
        if model is None and Path(name_or_path).is_dir():
            check_classifier(name_or_path, self.auto_class, trust_remote_code, revision)
        # a timed-out first call may still be loading when the next call starts
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self.tokenizer is None:
                self.tokenizer = AutoTokenizer.from_pretrained(
                    self.name_or_path, trust_remote_code=self.trust_remote_code, revision=self.revision)
            if self.model is None:
                device = resolve_device(self.device)
                on_device = {"device_map": device} if device.type != "cpu" else {}  # straight onto the GPU
                model, info = getattr(transformers, self.auto_class).from_pretrained(
                    self.name_or_path, dtype=resolve_dtype(self.dtype, device), output_loading_info=True,
                    trust_remote_code=self.trust_remote_code, revision=self.revision, **on_device)
                if info.get("missing_keys"):  # transformers would start that head from random weights
                    what, option, command = _KIND[self.auto_class]
                    raise ConfigError(f"{self.name_or_path} has no weights for {sorted(info['missing_keys'])[0]}: "
                                      f"it is not a trained {what} model, which {option} needs; train one with "
                                      f"`{command}` and pass its RUN/model folder")
                self.model = model.to(device).eval()
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            # sequence-classification heads find each row's last token through pad_token_id
            if getattr(self.model.config, "pad_token_id", None) is None:
                self.model.config.pad_token_id = self.tokenizer.pad_token_id
        return self.model, self.tokenizer

    def _texts(self, prompts, completions) -> tuple[list[str], list[int]]:
        """Model inputs and where each completion starts in its input, in characters."""
        head = self.template.split("{completion}")[0]
        texts, starts = [], []
        for prompt, completion in zip(prompts, completions, strict=True):
            starts.append(len(head.format(prompt=prompt)))
            texts.append(self.template.format(prompt=prompt, completion=completion))
        return texts, starts

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., num_labels] logits -> [...] scores."""
        logits = logits.float()
        if logits.shape[-1] == 1:
            return torch.sigmoid(logits[..., 0]) if self.sigmoid else logits[..., 0]
        if not -logits.shape[-1] <= self.label < logits.shape[-1]:
            raise ConfigError(f"reward model label {self.label} is out of range for its "
                              f"{logits.shape[-1]} labels; set label to 0..{logits.shape[-1] - 1}")
        return torch.softmax(logits, dim=-1)[..., self.label]

    @torch.no_grad()
    def _batches(self, texts: list[str], offsets: bool):
        """Yield (first row index, tokenizer encoding, logits) per batch, right-padded."""
        model, tokenizer = self._load()
        device = next(model.parameters()).device
        limit = max_input_tokens(model, tokenizer)
        for first in range(0, len(texts), self.batch_size):
            side, tokenizer.truncation_side = tokenizer.truncation_side, self.truncation_side
            try:  # inputs past the model's positions would index outside its table (or silently extrapolate)
                enc = tokenizer(texts[first:first + self.batch_size], return_tensors="pt", padding=True,
                                padding_side="right", return_offsets_mapping=offsets, truncation=limit is not None,
                                max_length=limit)
            finally:
                tokenizer.truncation_side = side
            inputs = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            yield first, enc, model(**inputs).logits


class SequenceClassifierReward(_HFScorer):
    """ORM: one score per completion from a sequence-classification head (an outcome function).

    An input longer than the model reads loses its start: the head reads the last token, so the end of
    the completion (its answer) is what must stay.
    """

    auto_class = "AutoModelForSequenceClassification"
    truncation_side = "left"

    def __call__(self, prompts, completions, **_) -> list[float]:
        texts, _starts = self._texts(prompts, completions)
        scores: list[float] = []
        for _first, _enc, logits in self._batches(texts, offsets=False):
            scores += self._score(logits).tolist()  # [B, num_labels] -> [B]
        return scores


class TokenClassifierPRM(_HFScorer):
    """PRM: a score per step, read at the step's last character (a `ProcessReward` scorer).

    Steps are split as `grpo_cli.rewards.steps.split_steps(completion, pattern)`. An input longer than
    the model reads loses its end, so token offsets still line up with the text: steps that end past the
    cut get no reward (they are left out of the row's steps).
    """

    auto_class = "AutoModelForTokenClassification"

    # spelled out (not **options) so config validation can check each key against it
    def __init__(self, name_or_path: str | None = None, *, pattern: str | None = None, model=None,
                 tokenizer=None, template: str = "{prompt}{completion}", label: int = 1, sigmoid: bool = True,
                 batch_size: int = 8, device: str = "auto", dtype: str = "auto",
                 trust_remote_code: bool = False, revision: str | None = None):
        super().__init__(name_or_path, model=model, tokenizer=tokenizer, template=template, label=label,
                         sigmoid=sigmoid, batch_size=batch_size, device=device, dtype=dtype,
                         trust_remote_code=trust_remote_code, revision=revision)
        self.pattern = pattern

    def __call__(self, prompts, completions, **_) -> list[list[tuple[int, float]]]:
        texts, starts = self._texts(prompts, completions)
        spans = [split_steps(c, self.pattern) for c in completions]
        result: list[list[tuple[int, float]]] = []
        for first, enc, logits in self._batches(texts, offsets=True):
            scores = self._score(logits).cpu()  # [B, T]
            for row in range(scores.shape[0]):
                i = first + row
                # offset_mapping[t] = (start, end) characters of token t; pads are (0, 0)
                token_ends = [end for _, end in enc["offset_mapping"][row].tolist()]
                steps = []
                for _, char_end in spans[i]:
                    last_char = starts[i] + char_end - 1
                    # the first token that ends past the step's last character holds it
                    t = next((t for t, end in enumerate(token_ends) if end > last_char), None)
                    if t is not None:
                        steps.append((char_end, float(scores[row, t])))
                result.append(steps)
        return result


def outcome_reward_model(name_or_path: str | None, *, template: str, label: int, sigmoid: bool, batch_size: int,
                         device: str, dtype: str, trust_remote_code: bool, outcome: dict | None,
                         timeout_s: float | None, revision: str | None = None, model=None, tokenizer=None):
    """reward=orm: an `OutcomeReward` whose reward is the ORM's score alone.

    Built by one flat config node so the model is `reward.name_or_path=...` on the command line;
    `outcome` functions are scored with weight 0, for their `rewards/<name>/mean` metrics only.
    """
    orm = SequenceClassifierReward(name_or_path, model=model, tokenizer=tokenizer, template=template, label=label,
                                   sigmoid=sigmoid, batch_size=batch_size, device=device, dtype=dtype,
                                   trust_remote_code=trust_remote_code, revision=revision)
    metrics = dict(outcome or {})
    if "orm" in metrics:
        raise ConfigError("reward.outcome.orm clashes with the model's own score of that name; rename it")
    # thread: the model lives in this process (on its device), and a worker process would load it again
    return OutcomeReward({"orm": orm, **metrics}, weights={"orm": 1.0, **{k: 0.0 for k in metrics}},
                         timeout_s=timeout_s, worker="thread")


def process_reward_model(name_or_path: str | None, *, pattern: str | None, template: str, label: int,
                         sigmoid: bool, batch_size: int, device: str, dtype: str, trust_remote_code: bool,
                         outcome: dict | None, timeout_s: float | None, credit: str, revision: str | None = None,
                         model=None, tokenizer=None):
    """reward=prm: a `ProcessReward` over `TokenClassifierPRM`, from one flat config node
    (`reward.name_or_path=...`); `outcome` functions are scored for metrics only."""
    prm = TokenClassifierPRM(name_or_path, pattern=pattern, model=model, tokenizer=tokenizer, template=template,
                             label=label, sigmoid=sigmoid, batch_size=batch_size, device=device, dtype=dtype,
                             trust_remote_code=trust_remote_code, revision=revision)
    return ProcessReward(prm, outcome=outcome, timeout_s=timeout_s, process_weight=None, worker="thread",  # as the ORM
                         credit=credit)

# ---- config checks: this module's settings, collected by config.validate --------------------------------

def _loadable(name_or_path) -> bool:
    """null (iterative RL trains one; otherwise the scorer names the key), a folder that exists, or a hub id
    ("name" or "org/name"). Anything else would reach the hub only at the first score, whose error then
    leaves every completion unscored."""
    if name_or_path is None:
        return True
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        return False
    if Path(name_or_path).expanduser().is_dir():
        return True
    looks_like_a_path = name_or_path.startswith(("/", ".", "~")) or "\\" in name_or_path
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return False
    return not looks_like_a_path


CHECKS: list[Check] = [
    Rule("reward.name_or_path", _loadable,
         "is neither a folder that exists nor a hub id (ORG/MODEL); set reward.name_or_path= to the folder `grpo rm` "
         "wrote (RUN/model) or a hub id"),
]
