"""Checkpoints: safetensors + JSON + YAML only (no pickle), written atomically, rotated.

A checkpoint folder `checkpoints/step_NNNNNN/` holds:
  adapter_model.safetensors, adapter_config.json   the peft LoRA adapter (loadable by plain peft)
  optimizer.safetensors, optimizer.json             optimizer tensors / everything else in its state
  scheduler.json                                    LR scheduler state
  trainer_state.json                                step, data position, RNG state, metrics so far
  config.yaml                                       the resolved run config
It is written to `step_NNNNNN.tmp` and renamed into place, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

STEP_DIR = "step_{:06d}"
ADAPTER = "adapter_model.safetensors"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / STEP_DIR.format(step)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    found = [p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
             and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resolve(path: str | Path) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run folder."""
    path = Path(path)
    if (path / "trainer_state.json").exists():
        return path
    found = list_checkpoints(path)
    if not found:
        from grpo_cli.errors import ConfigError

        raise ConfigError(f"{path} is neither a checkpoint (no trainer_state.json) nor a run folder with "
                          f"checkpoints/step_*; pass a path printed by `grpo train`")
    return found[-1]


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
         keep_last: int | None = None) -> Path:
    """Write checkpoint `step` atomically; delete all but the newest `keep_last`. Returns its path."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_pretrained(tmp, safe_serialization=True)
    (tmp / "README.md").unlink(missing_ok=True)  # peft's model card: not part of the checkpoint
    tensors, plain = _optimizer_to_files(optimizer.state_dict())
    save_file(tensors, tmp / "optimizer.safetensors")
    (tmp / "optimizer.json").write_text(json.dumps(plain, default=_json_default))
    (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), default=_json_default))
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1, default=_json_default))
    OmegaConf.save(config, tmp / "config.yaml", resolve=True)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep_last:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_adapter(policy, path: Path) -> None:
    """Load a checkpoint's LoRA weights into `policy` (a peft model with the same adapter config)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(policy, load_file(Path(path) / ADAPTER))
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        from grpo_cli.errors import ConfigError

        raise ConfigError(f"{path}: adapter weights do not fit this model ({unexpected[0]} ...); "
                          f"use the model the checkpoint was trained with")


def load_training_state(path: Path, optimizer, scheduler) -> dict:
    """Restore optimizer and scheduler; return trainer_state."""
    path = Path(path)
    tensors = load_file(path / "optimizer.safetensors")
    optimizer.load_state_dict(_optimizer_from_files(tensors, json.loads((path / "optimizer.json").read_text())))
    scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    return json.loads((path / "trainer_state.json").read_text())


def load_config(path: Path) -> DictConfig:
    return OmegaConf.load(Path(path) / "config.yaml")
