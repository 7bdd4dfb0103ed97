"""`grpo export`: a checkpoint as a model folder that other tools load without grpo-cli.

    grpo export checkpoint=outputs/train/DATE/TIME output=smollm2-arith         # merged, as it trained
    grpo export checkpoint=RUN output=DIR export.dtype=bfloat16                   # half the size, for GPUs
    grpo export checkpoint=RUN/checkpoints/step_000020 output=DIR export.merge=false
    grpo export checkpoint=RUN/last output=DIR       # the newest checkpoint; RUN (and RUN/best) takes the best

Merged (default): the LoRA update B·A·(alpha/r) is added into the base weights (peft's
`merge_and_unload`) and the result is a plain Hugging Face folder: `model.safetensors`,
`config.json`, the tokenizer with its chat template, and a `generation_config.json` that holds only
the bos/eos/pad token ids, so `AutoModelForCausalLM.from_pretrained(DIR)`, a transformers pipeline
and `vllm serve DIR` sample exactly as they are asked to (no repetition penalty, temperature or
top-p sneaks in from the base model's defaults).

`export.merge=false`: the peft adapter folder (`adapter_model.safetensors`, `adapter_config.json`)
plus the tokenizer. The adapter config's `base_model_name_or_path` names the base: the absolute
path of a local base folder (for the embedded SmolLM2 that is the dequantized safetensors cache
`policy.load_embedded_gguf` writes), or the hub id; a base built in memory (`model=tiny`) has no
files, so it is null and the caller passes the base model to `PeftModel.from_pretrained`.

Both write `export.json`: the source checkpoint and step, the base model's identity (name, path or
hub id, loader config), merge and dtype. Departures from the usual merge scripts: the merge runs
on the CPU in float32 whatever the run trained in (merging in bf16 rounds the LoRA delta away), and
only then are the weights cast to `export.dtype`: `auto` (the default) is the precision the policy
trained in (its checkpoint's trainer_state.json records it), so an fp32 CPU run exports the logits
it was trained and evaluated with. A run on a 4-bit base (`model.quantization=4bit`) merges into
dequant(W) + ΔW, the weights it trained against, and exports them in full precision (no bitsandbytes
needed to load them); `export.merge=false` writes the adapter, whose base is the full-precision
model (quantize it again with model.quantization=4bit to get the trained policy back). The folder
is written beside the target and renamed into place, so a failed export (a full disk: one `error:`
line, exit 1) never leaves half a model.

A full-parameter run (`model.finetune=full`) has no adapter: its checkpoint's weights are the model, written as
the merged folder is (`export.merge=false` is refused in one line).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from rich.table import Table
from transformers import GenerationConfig

from grpo_cli import __version__, checkpoint, files, quantize
from grpo_cli.app import command_line_overrides, hydra_app
from grpo_cli.config import validate
from grpo_cli.errors import ConfigError, RunError
from grpo_cli.inference import inherit, pick, say_checkpoint, warn
from grpo_cli.metrics.console import console, progress
from grpo_cli.policy import build_policy, resolve_device, resolve_dtype, trains_adapter
from grpo_cli.runs import read_saved

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@hydra_app("export")
def main(cfg: DictConfig) -> None:
    run(cfg, command_line_overrides())


def check(cfg: DictConfig) -> tuple[Path, Path]:
    """(checkpoint folder, output folder) after every check that needs no model: one line per problem."""
    missing = [f"{key} is required; pass {how}" for key, how in (
        ("checkpoint", "a run folder or checkpoint of `grpo train`: checkpoint=outputs/train/DATE/TIME"),
        ("output", "the folder to write: output=DIR")) if OmegaConf.is_missing(cfg, key)]
    if missing:
        raise ConfigError("\n".join(missing))
    validate(cfg)
    export_cfg = cfg.export
    if export_cfg.dtype != "auto" and export_cfg.dtype not in DTYPES:
        raise ConfigError(f"export.dtype ({export_cfg.dtype!r}) must be auto or one of {', '.join(DTYPES)}; "
                          f"set export.dtype=auto")
    for key in ("merge", "overwrite"):
        if not isinstance(export_cfg[key], bool):
            raise ConfigError(f"export.{key} ({export_cfg[key]!r}) must be true or false; set export.{key}=true")
    # a run folder's best checkpoint (its evals recorded one), else its newest whose files read; RUN/best, RUN/last;
    # said once the output is checked too: a refusal is its one line
    ckpt, why = pick(str(cfg.checkpoint), warn=warn)
    out = Path(str(cfg.output)).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output={out} is a file; pass a folder to create")
    if out.is_dir() and any(out.iterdir()):
        if not export_cfg.overwrite:
            raise ConfigError(f"output={out} is not empty; pass a new folder or set export.overwrite=true "
                              f"(the folder is replaced)")
        if out == ckpt.resolve() or out in ckpt.resolve().parents:
            raise ConfigError(f"output={out} holds the checkpoint {ckpt}; overwriting it would delete the "
                              f"checkpoint: pass another folder")
    say_checkpoint(ckpt, why)
    return ckpt, out


def trained_dtype(ckpt: Path) -> str:
    """The precision the checkpoint's policy trained in: its trainer_state's record, or (a checkpoint older
    than that record) its model.dtype resolved as the trainer resolves it, on this machine."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if state.get("dtype") in DTYPES:
        return state["dtype"]
    model = checkpoint.load_config(ckpt).model
    dtype = resolve_dtype(model.dtype, resolve_device(model.device))  # keys every saved model section holds
    return str(dtype).removeprefix("torch.")


def base_identity(model_cfg: DictConfig, base_model) -> dict:
    """Name, local folder or hub id, and loader config of the base weights a policy was built on."""
    name_or_path = getattr(base_model.config, "_name_or_path", "") or None
    if name_or_path and Path(name_or_path).is_dir():
        name_or_path = str(Path(name_or_path).resolve())  # an absolute path loads from any working dir
    loader = OmegaConf.to_container(model_cfg.loader, resolve=True)
    return {"name": model_cfg.get("name"), "name_or_path": name_or_path,
            "local": bool(name_or_path) and Path(name_or_path).is_dir(), "revision": loader.get("revision"),
            "loader": loader}


def generation_config(tokenizer):
    """Only the special-token ids: serving tools then sample with exactly the settings they are given."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=pad)


def run(cfg: DictConfig, overrides: list[str] = ()) -> Path:
    """Write the export of `cfg.checkpoint` into `cfg.output`; returns the output folder."""
    ckpt, out = check(cfg)
    export_cfg = cfg.export
    # the checkpoint's own model section (dotted command-line overrides on top), built on the CPU in
    # float32: the merge is exact there, and a GPU is not needed to export
    saved = read_saved(ckpt, ["model"], list(overrides), cfg.trust_run_config)  # data: runs.check_saved
    cfg = inherit(cfg, OmegaConf.create({"model": saved.model}), list(overrides))
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    validate(cfg)
    if cfg.model.finetune == "full" and not export_cfg.merge:
        raise ConfigError(f"export.merge=false writes a LoRA adapter, and {ckpt} trained every weight "
                          f"(model.finetune=full): there is no adapter; drop export.merge=false")
    step = json.loads((ckpt / "trainer_state.json").read_text()).get("step")
    dtype = trained_dtype(ckpt) if export_cfg.dtype == "auto" else export_cfg.dtype
    try:
        record, base = _write(cfg, ckpt, out, step, dtype)
    except Exception as err:
        if not files.io_error(err):
            raise
        # files.folder has removed the temporary folder: the output is as it was
        raise RunError(f"cannot write the export to {out} ({str(err).splitlines()[0][:200]}); it is as it "
                       f"was: free space, or pass another folder: output=...") from None

    console.print(files_table(out, record))
    if export_cfg.merge:
        how = f"AutoModelForCausalLM.from_pretrained({str(out)!r})  ·  vllm serve {out}"
    elif base["name_or_path"]:  # the adapter config names a base that loads by itself
        how = f"AutoPeftModelForCausalLM.from_pretrained({str(out)!r})"
    else:  # a base built in memory (model=tiny): the caller builds it
        how = f"PeftModel.from_pretrained(base_model, {str(out)!r})"
    console.print(f"exported {ckpt} (step {step}) to {out}\nload with: {how}")
    return out


def _write(cfg: DictConfig, ckpt: Path, out: Path, step, dtype: str) -> tuple[dict, dict]:
    """Build the policy, load the adapter, and write the export into `out` atomically; (export.json record,
    base identity)."""
    export_cfg = cfg.export
    with progress("export") as bar, files.folder(out) as tmp:
        task = bar.add_task("", total=4, info="base model")
        policy, tokenizer, _ = build_policy(cfg.model)
        full = not trains_adapter(policy)  # model.finetune=full: the policy is the causal LM itself
        base = base_identity(cfg.model, policy if full else policy.get_base_model())
        bar.update(task, advance=1, info="adapter")
        checkpoint.load_weights(policy, ckpt)
        policy.eval()
        bar.update(task, advance=1, info="merge" if export_cfg.merge else "adapter folder")
        if export_cfg.merge:
            # a 4-bit base (model.quantization=4bit): dequant(W) + ΔW in float32; peft's merge would quantize it again
            if full:
                merged = policy
            elif cfg.model.quantization:
                merged = quantize.merge_dequantized(policy)
            else:
                merged = policy.merge_and_unload()
            model = merged.to(DTYPES[dtype])
            model.generation_config = generation_config(tokenizer)
            bar.update(task, advance=1, info="write")
            model.save_pretrained(tmp)
        else:
            policy.peft_config["default"].base_model_name_or_path = base["name_or_path"]
            if base["revision"]:
                policy.peft_config["default"].revision = base["revision"]
            bar.update(task, advance=1, info="write")
            policy.to(DTYPES[dtype]).save_pretrained(tmp)
            (tmp / "README.md").unlink(missing_ok=True)  # peft's empty model card
        tokenizer.save_pretrained(tmp)
        record = {"checkpoint": str(ckpt.resolve()), "step": step, "merged": export_cfg.merge,
                  "dtype": dtype, "quantization": cfg.model.quantization, "finetune": cfg.model.finetune,
                  "base_model": base,
                  "grpo_cli_version": __version__}
        (tmp / "export.json").write_text(json.dumps(record, indent=1) + "\n")
        bar.update(task, advance=1, info="done")
    return record, base


def files_table(out: Path, record: dict) -> Table:
    table = Table(title=f"grpo export · {'merged' if record['merged'] else 'adapter'} · {record['dtype']}")
    table.add_column("file")
    table.add_column("size", justify="right")
    for path in sorted(out.iterdir()):
        table.add_row(path.name, _size(path.stat().st_size))
    return table


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""
