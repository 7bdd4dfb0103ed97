"""The reward model: a one-logit ORM/PRM head on the base LM's backbone (new, or loaded from a
`grpo rm` folder), LoRA on the backbone, binary cross-entropy training, scoring and held-out metrics
(accuracy, AUC), the atomic save, and the checks of the `rm` settings (conf/rm/default.yaml).

Both classes count (rm.balance=true, issue #28): a policy that is rarely right gives rows that are
almost all wrong (11 right of 120 in the measured iterative run), and a plain BCE then learns the base
rate ("always wrong" is 91% accurate) instead of what makes an answer right. We chose a class-weighted
BCE, `pos_weight` = n_negative / n_positive counted on the training mix (`class_weight`), over drawing
more samples until a share of them is right: it costs no sampling time, it is the same function of the
rows on a resume, and it works at any positive rate, where drawing until 10% are right from a policy right
1% of the time needs ~10x the samples. Its cost: few positives weigh a lot, so one odd right answer can
pull the model; the gate (rm.min_auc, grpo_cli/iterative.py) catches a model that learned nothing.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoTokenizer

from grpo_cli import files
from grpo_cli.checks import is_num
from grpo_cli.errors import ConfigError
from grpo_cli.instantiate import build
from grpo_cli.rewards.models import check_classifier
from grpo_cli.rm.auc import binary_auc, within_prompt_auc
from grpo_cli.rm.rows import Row, check_share

KINDS = ("outcome", "process")
# the transformers auto class each kind of reward model is saved as and loaded with
AUTO_CLASS = {"outcome": "AutoModelForSequenceClassification", "process": "AutoModelForTokenClassification"}


# ---- settings ----------------------------------------------------------------------------------

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
    if not is_num(R.lr) or R.lr <= 0:
        raise ConfigError(f"rm.lr ({R.lr!r}) must be > 0; set rm.lr=1e-4")
    if not isinstance(R.template, str) or R.template.count("{completion}") != 1 or "{prompt}" not in R.template:
        raise ConfigError(f"rm.template ({R.template!r}) must hold {{prompt}} and {{completion}} once each, as "
                          f"reward.template does where the model scores; set rm.template='{{prompt}}{{completion}}'")
    check_share(R.replay.share)
    if R.min_auc is not None and (isinstance(R.min_auc, bool) or not isinstance(R.min_auc, (int, float))
                                  or not 0 <= R.min_auc <= 1):
        raise ConfigError(f"rm.min_auc ({R.min_auc!r}) must be in [0, 1] (0.5: chance) or null (no gate); "
                          f"set rm.min_auc=0.6")
    if not isinstance(R.balance, bool):
        raise ConfigError(f"rm.balance ({R.balance!r}) must be true or false (weigh each class's loss by the other's "
                          f"count); set rm.balance=true")


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


def class_weight(rows: list[Row], kind: str) -> float:
    """BCE's `pos_weight` that gives both classes the same total weight: n_negative / n_positive.

    Counted over the targets the loss sees (a row's label for an ORM, each labeled step for a PRM), a
    label >= 0.5 counting as positive, as `classification_metrics` counts it. 1.0 when a class is
    absent: there is nothing to balance (and 0 would erase the only class there is).
    """
    labels = [r["label"] for r in rows] if kind == "outcome" else [y for r in rows for _, y in r["steps"]]
    positive = sum(y >= 0.5 for y in labels)
    negative = len(labels) - positive
    return negative / positive if positive and negative else 1.0


def train_classifier(model, tokenizer, rows: list[Row], *, kind: str, template: str, epochs: int, batch_size: int,
                     lr: float, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0, seed: int = 0,
                     pos_weight: float | None = None,
                     advance: Callable[[int, float], None] | None = None) -> list[float]:
    """AdamW on binary cross-entropy over the trainable parameters; returns the loss of each batch.

    Rows are reshuffled every epoch (seeded); a batch's loss is the mean over its targets (rows for
    an ORM, labeled steps for a PRM), a positive target's term weighed by `pos_weight` (None: 1; see
    `class_weight`). `advance(rows_done, loss)` is called after each batch.
    """
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    weight = None if pos_weight is None else torch.tensor(float(pos_weight), device=device)
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
            # [S] logits vs [S] targets: -(w y log σ(x) + (1 - y) log(1 - σ(x))), averaged over the S targets
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets.to(logits.device),
                                                                        pos_weight=weight)
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
def _scored(model, tokenizer, rows: list[Row], kind: str, template: str,
            batch_size: int) -> tuple[list[float], list[float], list[int]]:
    """(scores in (0, 1), labels, the index of the row each came from): one per outcome row or labeled step."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    scores: list[float] = []
    labels: list[float] = []
    owners: list[int] = []
    for first in range(0, len(rows), batch_size):
        inputs, where, targets = encode(tokenizer, rows[first:first + batch_size], kind, template, device)
        if targets.numel():
            scores += torch.sigmoid(logits_at(model, inputs, where)).tolist()
            labels += targets.tolist()
            # an outcome row is one target; a process row's targets are its labeled steps (where[0]: their rows)
            owners += [first + b for b in (range(targets.numel()) if kind == "outcome" else where[0].tolist())]
    model.train(was_training)
    return scores, labels, owners


def predict(model, tokenizer, rows: list[Row], *, kind: str, template: str,
            batch_size: int = 8) -> tuple[list[float], list[float]]:
    """(scores in (0, 1), labels): one per outcome row or per labeled step, in row order."""
    scores, labels, _ = _scored(model, tokenizer, rows, kind, template, batch_size)
    return scores, labels


def classification_metrics(scores: list[float], labels: list[float], prompts: list) -> dict:
    """Accuracy at 0.5, the pooled and within-prompt AUCs (`grpo_cli.rm.auc`; `prompts`: the prompt of each
    score), BCE and mean score of scores against labels; a label >= 0.5 counts as positive."""
    positive = [y >= 0.5 for y in labels]
    n = len(labels)
    eps = 1e-7
    bce = -sum(y * math.log(max(s, eps)) + (1 - y) * math.log(max(1 - s, eps)) for s, y in zip(scores, labels))
    within = within_prompt_auc(scores, positive, prompts)
    return {"labels": n, "positives": sum(positive),
            "accuracy": sum((s >= 0.5) == p for s, p in zip(scores, positive)) / n if n else None,
            "auc": binary_auc(scores, positive), "auc_within_prompt": within.auc, "auc_prompts": within.prompts,
            "loss": bce / n if n else None, "mean_score": sum(scores) / n if n else None}


def evaluate(model, tokenizer, rows: list[Row], *, kind: str, template: str, batch_size: int = 8) -> dict:
    """Accuracy, AUCs (pooled, within prompt), BCE and mean score of the reward model on labeled rows (per step for
    a PRM, a step's prompt being its row's)."""
    scores, labels, owners = _scored(model, tokenizer, rows, kind, template, batch_size)
    return classification_metrics(scores, labels, [rows[i]["prompt"] for i in owners])


def retrain(model, tokenizer, train_rows: list[Row], heldout: list[Row], R, kind: str, seed: int | None = None,
            advance: Callable[[int, float], None] | None = None) -> tuple[Any, dict]:
    """(merged model, report): score `heldout` with `model`, train it on `train_rows` (LoRA on the
    backbone + the whole head, settings `R` = the `rm` config section), merge, score `heldout` again.

    Shared by `grpo rm` and the iterations of `grpo train`. The report holds `heldout_before`,
    `heldout_after` (`evaluate`'s metrics; None without held-out rows), the first and last batch loss and
    `pos_weight` (rm.balance: `class_weight` of `train_rows`; else None).
    """
    settings = dict(kind=kind, template=R.template, batch_size=R.batch_size)
    before = evaluate(model, tokenizer, heldout, **settings) if heldout else None
    pos_weight = class_weight(train_rows, kind) if R.balance else None
    model = add_lora(model, **R.lora)
    losses = train_classifier(model, tokenizer, train_rows, kind=kind, template=R.template, epochs=R.epochs,
                              batch_size=R.batch_size, lr=R.lr, weight_decay=R.weight_decay,
                              max_grad_norm=R.max_grad_norm, seed=R.seed if seed is None else seed,
                              pos_weight=pos_weight, advance=advance)
    model = model.merge_and_unload()
    after = evaluate(model, tokenizer, heldout, **settings) if heldout else None
    return model, {"heldout_before": before, "heldout_after": after, "train_loss_first": losses[0] if losses else None,
                   "train_loss_last": losses[-1] if losses else None, "pos_weight": pos_weight}
