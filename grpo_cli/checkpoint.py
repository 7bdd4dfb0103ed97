"""Checkpoints: safetensors + JSON + YAML only (no pickle), written atomically, rotated.

A checkpoint folder `checkpoints/step_NNNNNN/` holds:
  adapter_model.safetensors, adapter_config.json   the peft LoRA adapter (loadable by plain peft), or
  model.safetensors                                 with model.finetune=full, every weight of the policy under its
                                                    HF name; above `SHARD_BYTES` model-0000i-of-0000n.safetensors
                                                    and model.safetensors.index.json (HF's sharded layout)
  optimizer.safetensors, optimizer.json             optimizer tensors / everything else in its state
  scheduler.json                                    LR scheduler state
  trainer_state.json                                step, data position, RNG state, metrics so far
  config.yaml                                       the resolved run config
  reference/adapter_model.safetensors, ...          iterative RL only: the reference policy's adapter
It is written to `step_NNNNNN.tmp`, flushed to disk (fsync) and renamed into place, so a crash never
leaves half a checkpoint. Weights that are not finite are never written. Every file is checked when
read (`verify`: the JSON that resume reads by its types and keys too, `json_shapes`); a run folder resolves
to its newest checkpoint that passes, and an error names the file at fault.

A run that evaluates itself during training records its best checkpoint in `RUN/best.json` (`record_best`), read
back as data (`read_best`); `keep_last` never deletes that checkpoint.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from grpo_cli import files
from grpo_cli.errors import CheckpointError, RunError
from grpo_cli.fsdp import like, shard_optimizer_state
from grpo_cli.json_shapes import shape_problem
from grpo_cli.policy import REFERENCE, set_reference, trains_adapter

STEP_DIR = "step_{:06d}"
ADAPTER = "adapter_model.safetensors"
# the folder peft's save_pretrained gives a second adapter (grpo_cli.policy.REFERENCE)
REFERENCE_DIR = "reference"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / STEP_DIR.format(step)


_STEP = re.compile(r"step_(\d+)")
# what every checkpoint folder holds; verify() reads each one
FILES = (ADAPTER, "adapter_config.json", "optimizer.safetensors", "optimizer.json", "scheduler.json",
         "trainer_state.json", "config.yaml")
# a full-parameter checkpoint's weights (model.finetune=full): one file, or above SHARD_BYTES shards and an index
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
# the largest shard of a full-parameter checkpoint (HF's own default size): fewer files than many small ones, and
# a file that a reader can map without holding two shards at once
SHARD_BYTES = 5 * 10**9


def step_of(path: Path) -> int | None:
    """N for a folder named step_N (digits only), else None (`step_000002.tmp`, `step_2.bak`, ...)."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders of a run (named step_N, with a trainer_state.json), oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*") if p.is_dir() and step_of(p) is not None
             and (p / "trainer_state.json").exists()]
    return sorted(found, key=step_of)


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` that is missing, unreadable or, for the JSON
    that resume reads, of the wrong shape (types and keys: `shape_problem`), before any model loads."""
    path = Path(path)
    extra = (f"{REFERENCE_DIR}/{ADAPTER}", f"{REFERENCE_DIR}/adapter_config.json")
    tensors: set[str] = set()  # what optimizer.safetensors holds, which optimizer.json names
    names = FILES + (extra if (path / REFERENCE_DIR).is_dir() else ())
    if _full(path):  # model.finetune=full: the weights instead of the adapter, each shard read as the adapter is
        read_weights(path)
        names = FILES[2:]
    for name in names:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; use an earlier one")
        try:
            if name.endswith(".safetensors"):
                loaded = load_file(file)
                if name.endswith(ADAPTER) and not all(bool(t.isfinite().all()) for t in loaded.values()):
                    raise ValueError("it holds NaN or infinite weights")
                tensors = set(loaded) if name == "optimizer.safetensors" else tensors
            elif name.endswith(".json"):
                problem = shape_problem(name, json.loads(file.read_text()), tensors)
                if problem:
                    raise CheckpointError(f"{file} has the wrong shape: {problem}; grpo train did not write it so "
                                          f"(edited or damaged): use an earlier checkpoint")
            else:  # no alias expanded, bounded: data from anyone; kept for the command's next read (load_config)
                _parsed_config(files.read_small(file, files.YAML_MAX_BYTES).decode(errors="replace"))
        except CheckpointError:
            raise
        except Exception as err:  # safetensors, JSON and YAML each raise their own kinds
            raise CheckpointError(f"{file} cannot be read ({str(err).splitlines()[0][:200]}); "
                                  f"use an earlier checkpoint") from None


def resolve(path: str | Path, *, warn=None) -> Path:
    """A checkpoint folder as given (verified), or the newest checkpoint of a run folder that verifies.

    A corrupt newer checkpoint is passed over with one `warn(message)` line naming the file.
    """
    path = Path(path)
    if (path / "trainer_state.json").exists():
        verify(path)
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is neither a checkpoint (no trainer_state.json) nor a run folder with "
                              f"checkpoints/step_*; pass a path printed by `grpo train`")
    problems = []
    for candidate in reversed(found):
        try:
            verify(candidate)
        except CheckpointError as err:
            problems.append(str(err))
            if warn is not None:
                warn(f"skipping {candidate.name}: {err}")
            continue
        return candidate
    raise CheckpointError(f"no usable checkpoint in {path}: {problems[0]}")


# ---- the best checkpoint: RUN/best.json, written after each held-out eval during training ---------------------------

BEST = "best.json"
# the largest best.json read back: grpo train writes ~100 bytes
BEST_BYTES = 4096


def read_best(run_dir: Path) -> dict | None:
    """RUN/best.json as recorded ({"step", "checkpoint", "metric", "score"}), or None when the run has none.

    A run folder is data (docs/runs.md): anything but a small regular file holding that object, its checkpoint the
    `checkpoints/step_NNNNNN` of its step (no other folder, nothing out of the run), is one CheckpointError line.
    The file is opened without following a link and without waiting on a FIFO, and checked once open.
    """
    file = Path(run_dir) / BEST
    fix = "grpo train did not write it so (edited or damaged): delete it, or pass RUN/last"
    try:
        data = files.read_small(file, BEST_BYTES, links=False)
    except FileNotFoundError:
        return None
    except ValueError as err:  # not a regular file, or too large
        raise CheckpointError(f"{file} cannot be read ({err}); {fix}") from None
    except OSError as err:  # ELOOP: a link
        raise CheckpointError(f"{file} cannot be read ({err.strerror}; a link is not followed); {fix}") from None
    try:
        record = json.loads(data)
    except ValueError as err:
        raise CheckpointError(f"{file} is not JSON ({str(err).splitlines()[0][:120]}); {fix}") from None
    problem = shape_problem(BEST, record, set())
    if not problem and record["checkpoint"] != f"checkpoints/{STEP_DIR.format(record['step'])}":
        problem = (f'names "checkpoint" {repr(record["checkpoint"])[:60]}, not its step\'s '
                   f"checkpoints/{STEP_DIR.format(record['step'])}")
    if problem:
        raise CheckpointError(f"{file} {problem}; {fix}")
    return record


def record_best(run_dir: Path, step: int, metric: str, score: float, *, warn=None) -> bool:
    """After a held-out eval of checkpoint `step`: record it in RUN/best.json (atomically) when `score` is higher than
    the recorded best, or none is recorded. Returns whether it wrote.

    An equal score keeps the record: a tie is no evidence that the later checkpoint is better, and the earlier one
    has moved less from where RL started. A score that is not finite is never recorded. A best.json that does not
    read (`read_best`) is replaced, with one `warn(line)`: a damaged record must not stop the run. A record of
    another metric cannot be compared with this one and is replaced too.
    """
    if not math.isfinite(score):
        return False
    try:
        recorded = read_best(run_dir)
    except CheckpointError as err:
        recorded = None
        if warn is not None:
            warn(f"{err} (replacing it)")
    if recorded is not None and recorded["metric"] == metric and score <= recorded["score"]:
        return False
    record = {"step": int(step), "checkpoint": f"checkpoints/{STEP_DIR.format(step)}", "metric": metric,
              "score": float(score)}
    files.write_text(Path(run_dir) / BEST, json.dumps(record) + "\n")
    return True


def _best_step(run_dir: Path) -> int | None:
    """The recorded best's step, or None (no best.json, or one that does not read: it protects nothing)."""
    try:
        record = read_best(run_dir)
    except CheckpointError:
        return None
    return record["step"] if record else None


def best_checkpoint(run_dir: Path, *, warn=None) -> Path | None:
    """The folder of the run's recorded best checkpoint (verified), or None: no best.json, one that does not read,
    or a checkpoint that is gone or damaged (each of those with one `warn(line)`)."""
    try:
        record = read_best(run_dir)
    except CheckpointError as err:
        if warn is not None:
            warn(str(err))
        return None
    if record is None:
        return None
    path = checkpoint_dir(run_dir, record["step"])
    if not path.is_dir():
        if warn is not None:
            warn(f"{Path(run_dir) / BEST} names {path.name}, which is gone from {path.parent}")
        return None
    try:
        verify(path)
    except CheckpointError as err:
        if warn is not None:
            warn(f"the best checkpoint {path.name} does not read: {err}")
        return None
    return path


def _optimizer_to_files(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split optimizer.state_dict() into tensors (safetensors) and plain values (JSON)."""
    tensors, plain = {}, {"param_groups": state["param_groups"], "state": {}}
    for idx, slots in state["state"].items():
        plain["state"][str(idx)] = {}
        for name, value in slots.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().contiguous().cpu()
                plain["state"][str(idx)][name] = {"tensor": f"{idx}.{name}"}
            else:
                plain["state"][str(idx)][name] = value
    return tensors, plain


def _optimizer_from_files(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    state = {}
    for idx, slots in plain["state"].items():
        state[int(idx)] = {name: tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v
                           for name, v in slots.items()}
    return {"state": state, "param_groups": plain["param_groups"]}


def _json_default(value):
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def save(run_dir: Path, step: int, policy, optimizer, scheduler, trainer_state: dict, config: DictConfig,
         keep_last: int | None = None, *, gathered: tuple[dict, dict] | None = None) -> Path:
    """Write checkpoint `step` atomically; delete all but the newest `keep_last`. Returns its path.

    `gathered`: (weights by name, optimizer state dict) of a full-parameter policy sharded over the ranks, gathered
    whole (`grpo_cli.fsdp.gather_state`), written in place of the policy's and the optimizer's own, in the same files.
    Refuses (RuntimeError) weights that are not finite: a NaN checkpoint would poison every resume.
    """
    trainable = list(gathered[0].values()) if gathered else [p for p in policy.parameters() if p.requires_grad]
    if not all(bool(p.isfinite().all()) for p in trainable):
        raise RuntimeError(f"refusing to save step {step}: the trained weights are not finite")
    final = checkpoint_dir(run_dir, step)
    try:
        with files.folder(final) as tmp:
            if trains_adapter(policy):
                policy.save_pretrained(tmp, safe_serialization=True)
                (tmp / "README.md").unlink(missing_ok=True)  # peft's model card: not part of the checkpoint
            elif gathered:
                write_weights(gathered[0], tmp)
            else:
                save_weights(policy, tmp)
            tensors, plain = _optimizer_to_files(gathered[1] if gathered else optimizer.state_dict())
            save_file(tensors, tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps(plain, default=_json_default))
            (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=_json_default))
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=_json_default))
            OmegaConf.save(config, tmp / "config.yaml", resolve=True)
    except Exception as err:  # disk full, a read-only folder (safetensors raises its own error type)
        raise RunError(f"cannot write checkpoint {final} ({str(err).splitlines()[0][:200]}); the earlier "
                       f"checkpoints are intact: free space and resume with: grpo train resume={run_dir}") from None
    if keep_last:
        best = _best_step(run_dir)  # kept beside the newest keep_last: it is what export and sample take
        for old in list_checkpoints(run_dir)[:-keep_last]:
            if step_of(old) != best:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _full(path: Path) -> bool:
    """The checkpoint holds full weights (model.finetune=full), not an adapter."""
    return not (path / "adapter_config.json").exists() and any((path / n).exists() for n in (WEIGHTS, WEIGHTS_INDEX))


def weights_file(path: Path) -> Path:
    """The file that names a checkpoint's trained weights: the adapter, the full weights or their shards' index."""
    path = Path(path)
    if not _full(path):
        return path / ADAPTER
    return path / (WEIGHTS_INDEX if (path / WEIGHTS_INDEX).exists() else WEIGHTS)


def save_weights(model, folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Every parameter of `model` under its name (a tied weight once), in one file or in shards of at most
    `shard_bytes` with HF's index, so the folder's weights also read as a sharded HF checkpoint's."""
    write_weights(dict(model.named_parameters()), folder, shard_bytes)


def write_weights(weights: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """`weights` (name -> tensor, in order) as `save_weights` writes a model's."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, p in weights.items():
        nbytes = p.numel() * p.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = p.detach().contiguous().cpu()
        size, total = size + nbytes, total + nbytes
    if len(shards) == 1:
        save_file(shards[0], Path(folder) / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, Path(folder) / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (Path(folder) / WEIGHTS_INDEX).write_text(json.dumps(index, indent=1))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A full-parameter checkpoint's weights, every file checked: a missing, unreadable or non-finite one is one
    CheckpointError naming it."""
    path = Path(path)
    index = path / WEIGHTS_INDEX
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [WEIGHTS]
    except Exception as err:
        raise CheckpointError(f"{index} cannot be read ({str(err).splitlines()[0][:200]}); use an earlier "
                              f"checkpoint") from None
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; use an earlier one")
        try:
            loaded = load_file(file)
        except Exception as err:
            raise CheckpointError(f"{file} cannot be read ({str(err).splitlines()[0][:200]}); use an earlier "
                                  f"checkpoint") from None
        if not all(bool(t.isfinite().all()) for t in loaded.values()):
            raise CheckpointError(f"{file} cannot be read (it holds NaN or infinite weights); use an earlier "
                                  f"checkpoint")
        weights.update(loaded)
    return weights


def load_full_weights(model, path: Path) -> None:
    """Copy a full-parameter checkpoint's weights into `model`, every parameter; one line when they do not fit. A
    model sharded over the ranks (trainer.fsdp) takes each rank's shard of them (every rank reads the files)."""
    weights = read_weights(path)
    params = dict(model.named_parameters())
    wrong = sorted(weights.keys() ^ params.keys()) or [k for k in params if weights[k].shape != params[k].shape]
    if wrong:
        raise CheckpointError(f"{weights_file(path)}: the weights do not fit this model ({wrong[0]} ...); use the "
                              f"model the checkpoint was trained with")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(like(weights[name], p))


def load_weights(policy, path: Path) -> None:
    """Load a checkpoint's trained weights into `policy`: its LoRA adapter, or with model.finetune=full every
    weight; a checkpoint of the other kind is one line."""
    full = _full(Path(path))
    if full == trains_adapter(policy):
        kind, other = ("full weights", "lora") if full else ("a LoRA adapter", "full")
        raise CheckpointError(f"{path} holds {kind}, and this policy is model.finetune={other}; drop the "
                              f"model.finetune override (the checkpoint's config.yaml says which)")
    if full:
        load_full_weights(policy, path)
    else:
        load_adapter(policy, path)


def load_adapter(policy, path: Path) -> None:
    """Load a checkpoint's LoRA weights into `policy` (a peft model with the same adapter config)."""
    file = Path(path) / ADAPTER
    try:
        weights = load_file(file)
    except Exception as err:
        raise CheckpointError(f"{file} cannot be read ({str(err).splitlines()[0][:200]})") from None
    try:
        result = set_peft_model_state_dict(policy, weights)
    except RuntimeError as err:  # size mismatch: another base model or another LoRA rank
        raise CheckpointError(f"{file}: adapter weights do not fit this model ({str(err).splitlines()[-1][:160]}); "
                              f"use the model and model.lora settings the checkpoint was trained with") from None
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise CheckpointError(f"{file}: adapter weights do not fit this model ({unexpected[0]} ...); "
                              f"use the model the checkpoint was trained with")


def load_reference(policy, path: Path) -> bool:
    """Make the checkpoint's reference adapter (iterative RL) the policy's reference; False if it has none."""
    file = Path(path) / REFERENCE_DIR / ADAPTER
    if not file.exists():
        return False
    set_reference(policy)  # creates the adapter; the weights come next
    set_peft_model_state_dict(policy, load_file(file), adapter_name=REFERENCE)
    return True


def set_aside_after(run_dir: Path, step: int) -> Path | None:
    """Move the checkpoints newer than `step` (an abandoned branch) to checkpoints/abandoned-TIME/.

    Resuming from an older checkpoint starts a new branch; its newer siblings would otherwise be
    picked by `resolve`, eval and `keep_last`. A best.json naming one of them goes with them. Returns the folder
    they went to (None: nothing newer).
    """
    newer = [p for p in list_checkpoints(run_dir) if step_of(p) > step]
    if not newer:
        return None
    aside = Path(run_dir) / "checkpoints" / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for folder in newer:
        folder.rename(aside / folder.name)
    best = _best_step(run_dir)
    if best is not None and best > step:  # the abandoned branch's: the new branch's evals start their own
        (Path(run_dir) / BEST).rename(aside / BEST)
    return aside


def load_training_state(path: Path, optimizer, scheduler) -> dict:
    """Restore optimizer and scheduler; return trainer_state. Their shapes were checked by `verify`; what only the
    built optimizer can tell (another number of LoRA tensors) is one line too. An optimizer of sharded weights
    (trainer.fsdp with model.finetune=full) takes each rank's shard of the whole state the files hold."""
    path = Path(path)
    tensors = load_file(path / "optimizer.safetensors")
    try:
        state = _optimizer_from_files(tensors, json.loads((path / "optimizer.json").read_text()))
        optimizer.load_state_dict(shard_optimizer_state(optimizer, state))
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / 'optimizer.json'} does not fit this run's optimizer "
                              f"({str(err).splitlines()[0][:200]}); use the run's own settings or an earlier "
                              f"checkpoint") from None
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    return json.loads((path / "trainer_state.json").read_text())


def load_config(path: Path) -> DictConfig:
    """A checkpoint's config.yaml, read as data: refused before it is built when it holds an alias or is too large
    (files.checked_yaml). The caller's own copy: it may change it."""
    file = Path(path) / "config.yaml"
    try:
        return copy.deepcopy(_parsed_config(files.read_small(file, files.YAML_MAX_BYTES).decode(errors="replace")))
    except Exception as err:  # the check's ValueError, or YAML's own
        raise CheckpointError(f"{file} cannot be read ({str(err).splitlines()[0][:200]}); "
                              f"use an earlier checkpoint") from None


# eval and sample read a checkpoint's config.yaml up to three times (verify, the saved config they inherit, the
# base-model check), and each read parsed its ~1000 YAML nodes twice (the alias check's event stream, then
# OmegaConf's): the configs of the last few texts are kept, keyed by the text read, so an edited file is parsed anew
@functools.lru_cache(maxsize=4)
def _parsed_config(text: str) -> DictConfig:
    return OmegaConf.create(files.check_yaml_text(text))


# ---- model.init_adapter: a training run that starts from a saved adapter --------------------------------

def init_adapter_problems(cfg: DictConfig) -> list[str]:
    """The check of `grpo train` (its CHECKS name it), before the model loads: model.init_adapter names a folder
    with a LoRA adapter whose shape is model.lora's (another alpha would load without error and scale it wrongly)."""
    folder = OmegaConf.select(cfg, "model.init_adapter", default=None)
    if folder is None:
        return []
    if not isinstance(folder, str) or not folder:
        return [f"model.init_adapter ({folder!r}) must be a folder path or null; set model.init_adapter=null"]
    if OmegaConf.select(cfg, "model.finetune") == "full":
        return ["model.init_adapter starts a LoRA adapter, but model.finetune is full; set model.finetune=lora, "
                "or model.init_adapter=null"]
    path = Path(folder).expanduser()
    missing = [name for name in (ADAPTER, "adapter_config.json") if not (path / name).is_file()]
    if missing:
        return [f"model.init_adapter ({folder}) holds no {' or '.join(missing)}; pass a checkpoint folder "
                f"(RUN/checkpoints/step_N) or a peft adapter folder"]
    try:
        saved = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as err:
        return [f"model.init_adapter: {path / 'adapter_config.json'} cannot be read ({str(err)[:120]}); "
                f"pass a checkpoint folder (RUN/checkpoints/step_N) or a peft adapter folder"]
    lora = cfg.model.lora
    pairs = {"r": (saved.get("r"), lora.r), "alpha": (saved.get("lora_alpha"), lora.alpha),
             "target_modules": (sorted(saved.get("target_modules") or []), sorted(lora.target_modules))}
    return [f"model.init_adapter ({folder}) was trained with {key}={theirs}, model.lora.{key} is {ours}; "
            f"set model.lora.{key}={theirs}" for key, (theirs, ours) in pairs.items() if theirs != ours]


def start_from(policy, folder: str, reference: bool) -> str:
    """model.init_adapter: the saved adapter's weights into the policy's fresh one, and with `reference` (the loss
    reads it: β > 0) into the reference adapter too, as the paper's reference is the policy RL starts from (with no
    such copy it would be the base, adapter off). Returns the line that says which."""
    load_adapter(policy, Path(folder).expanduser())
    if reference:
        set_reference(policy)
    return (f"model.init_adapter: the policy starts from {folder}; reference: "
            f"{'the same adapter, frozen' if reference else 'none read (algo.beta=0)'}")
