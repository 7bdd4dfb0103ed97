"""`grpo train|eval|sample ...`: picks the subcommand and hands the rest of argv to its Hydra app."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import warnings

COMMANDS = {
    "train": ("train", "train a policy with GRPO (Hydra app over conf/train.yaml)"),
    "eval": ("evaluate", "evaluate saved checkpoints on held-out problems (conf/eval.yaml)"),
    "sample": ("sample", "print completions of a checkpoint or the base model (conf/sample.yaml)"),
    "rm": ("rm", "train an outcome or process reward model on labeled or self-sampled rows (conf/rm.yaml)"),
    "export": ("export", "write a checkpoint as a merged HF model or a peft adapter (conf/export.yaml)"),
}

USAGE = "usage: grpo {" + ",".join(COMMANDS) + "} [HYDRA OVERRIDES...] [--help] [--cfg job] [-m]\n\n" \
    "commands:\n" + "".join(
    f"  {name:<8}{text}\n" for name, (_, text) in COMMANDS.items()
) + "\nexamples:\n  grpo train +recipe=gsm8k data.path=train.jsonl\n  grpo train --help\n"


def default_allocator_conf(environ) -> None:
    """Set `expandable_segments:True` for PyTorch's CUDA caching allocator unless the user configured it.

    Rollouts and updates allocate tensors of ever-changing shapes (batch x a length that differs every
    step); with fixed-size segments the freed blocks fragment and the reserved memory climbs far above the
    allocated. It must be set before CUDA initializes, so before torch is imported. torch 2.9 renamed the
    variable to PYTORCH_ALLOC_CONF (the old name warns) and honours the new name for CUDA from 2.11 on.
    """
    if "PYTORCH_ALLOC_CONF" in environ or "PYTORCH_CUDA_ALLOC_CONF" in environ:
        return

    try:
        major, minor = (int(part) for part in importlib.metadata.version("torch").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        major, minor = 0, 0
    name = "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 11) else "PYTORCH_CUDA_ALLOC_CONF"
    environ[name] = "expandable_segments:True"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)

    # library chatter (deprecation notices, weight-loading bars) hides our own one-line messages
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(transformers|peft|torch|accelerate)\.")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    default_allocator_conf(os.environ)

    try:
        module = importlib.import_module("grpo_cli.commands." + COMMANDS[command][0])
        sys.argv = [f"grpo {command}", *rest]
        module.main()
    except KeyboardInterrupt:  # Ctrl-C while importing or composing, before a command's own handling
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
