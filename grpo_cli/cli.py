"""`grpo train|eval|sample ...`: picks the subcommand and hands the rest of argv to its Hydra app.

The process is set up here, once, before any command (or torch) is imported: the environment the
libraries read at import (log levels, progress bars, the CUDA allocator, vLLM's in-process engine),
warning filters, and glibc's mmap threshold. Library modules below leave the process as they find it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.metadata
import logging
import os
import sys
import warnings

from grpo_cli.server_url import early as early_server_problem

COMMANDS = {
    "train": ("train", "train a policy with GRPO (Hydra app over conf/train.yaml)"),
    "eval": ("evaluate", "evaluate saved checkpoints on held-out problems (conf/eval.yaml)"),
    "sample": ("sample", "print completions of a checkpoint or the base model (conf/sample.yaml)"),
    "rm": ("rm", "train an outcome or process reward model on labeled or self-sampled rows (conf/rm.yaml)"),
    "export": ("export", "write a checkpoint as a merged HF model or a peft adapter (conf/export.yaml)"),
    "serve": ("serve", "start vLLM's server for a run's model, for sampler=vllm_server (--print: its command line)"),
}

USAGE = "usage: grpo {" + ",".join(COMMANDS) + "} [HYDRA OVERRIDES...] [--help] [--cfg job] [-m] [-v]\n\n" \
    "commands:\n" + "".join(
    f"  {name:<8}{text}\n" for name, (_, text) in COMMANDS.items()
) + "\n-v (or GRPO_VERBOSE=1): the libraries' own warnings, logs and progress bars too\n" \
    "\nexamples:\n  grpo train +recipe=gsm8k data.path=train.jsonl\n  grpo train --help\n"


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


def limit_heap_growth(threshold: int = 64 * 2**20) -> bool:
    """Serve allocations above `threshold` bytes with mmap and the smaller ones from the heap, fixed.

    glibc's own threshold moves (it rises each time a large block is freed, up to 32 MB), so which tensors page-
    fault on every allocation changes during a run. Fixed at 64 MiB, the update's activations (a length bucket's
    [rows x tokens, hidden] MLP tensors) are reused from the heap instead of being mapped, zeroed and unmapped
    each time; larger blocks (an LM-head chunk's logits, the KV cache) are still mapped and go back to the OS
    when freed. A small threshold would make generation slower (page faults). What each threshold measured:
    docs/memory.md. Does nothing off glibc. Returns whether it took effect.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, threshold))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


# what vLLM reads from the environment (at import and at engine start), unless the user set it: the engine in
# this process (no spawned worker), on the trainer's threads (its log level: quiet_libraries); its compiled model
# cached by inductor's own cache, not vLLM's AOT artifact, which vLLM's CPU build cannot load back, so that only a
# machine's first start compiles (docs/sampling-vllm.md)
VLLM_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "VLLM_USE_AOT_COMPILE": "0"}

# set to 1 (or pass -v): the libraries' own warnings, logs and progress bars reach the console as they print them
VERBOSE = "GRPO_VERBOSE"

# libraries whose Python warnings (deprecations in their own code) are theirs to fix, not the user's
QUIET_WARNINGS = r"(transformers|peft|torch|accelerate|vllm)\."
# loggers that speak at import or first use and are no user's business: bitsandbytes (imported by peft) warns of an
# optional kernel package, matplotlib logs its font cache at INFO (Hydra's job logging prints INFO to the console),
# math-verify warns that its timeout is off where a reward runs it off the main thread (rewards/outcome.py: the
# reward's own thread timeout bounds the call there)
QUIET_LOGGERS = {"bitsandbytes": logging.ERROR, "matplotlib": logging.WARNING, "math_verify": logging.ERROR}


def setup_process(environ=None) -> None:
    """The process-wide settings of a grpo command, each only where the user has not set it."""
    environ = os.environ if environ is None else environ
    if environ.get(VERBOSE, "0") in ("", "0"):
        quiet_libraries(environ)
    for key, value in VLLM_ENVIRONMENT.items():
        environ.setdefault(key, value)
    if environ.get("VLLM_LOGGING_LEVEL") == "ERROR":
        # vLLM reads the level once, when it is imported: this also covers a process that imported it before (a
        # test run), and the loggers of its lazy imports (Triton's probes), which speak later
        logging.getLogger("vllm").setLevel(logging.ERROR)
    # bitsandbytes (the qlora extra) logs at import, on an AVX512-BF16 CPU, that an optional kernel package is
    # missing; peft imports it whenever it is installed, so every command would print that line. The CPU path
    # it is about stays off (quantize.quantize_4bit)
    bnb_logger = logging.getLogger("bitsandbytes")
    if bnb_logger.level == logging.NOTSET:
        bnb_logger.setLevel(logging.ERROR)
    default_allocator_conf(environ)
    limit_heap_growth()


def quiet_libraries(environ) -> None:
    """Library chatter (deprecation notices, C++ warnings, weight-loading bars, INFO logs) off the console, where
    it would hide our own one-line messages; errors still print. Each only where the user has not set it."""
    if not sys.warnoptions:  # -W or PYTHONWARNINGS: the user's own filters decide
        for category in (FutureWarning, DeprecationWarning, UserWarning):
            warnings.filterwarnings("ignore", category=category, module=QUIET_WARNINGS)
    environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    environ.setdefault("TQDM_DISABLE", "1")  # also vLLM's weight-loading bar (rollout/vllm.py reads it)
    # c10's TORCH_WARN lines ("[W... utils.cpp:68] Warning: NUMA binding ...", vLLM's CPU engine start); read when
    # torch loads, so set before it is imported
    environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # only vLLM's errors
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        sys.exit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if any(a in ("-v", "--verbose") for a in rest):  # ours, not Hydra's: the libraries' own output on the console
        os.environ[VERBOSE] = "1"
        rest = [a for a in rest if a not in ("-v", "--verbose")]
    if command == "serve" and "--print" in rest:  # grpo serve --print: the command line, not the server
        rest = [a for a in rest if a != "--print"] + ["serve.print=true"]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; use one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    setup_process()
    if command in ("train", "eval", "sample") and (problem := early_server_problem(rest)):
        print(f"error: {problem}", file=sys.stderr)  # before the imports: a missing server is seconds, not ten
        sys.exit(2)
    # the working folder is no library folder: a json.py there would stand in for json in every library. `python -m`
    # puts it first (kept in a checkout's root, where it is how grpo_cli itself imports); the user's own modules
    # (reward.funcs=my_rewards.fn, a `_target_`) resolve through grpo_cli.user_code
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if sys.path[:1] in ([""], [os.getcwd()]) and os.path.abspath(sys.path[0]) != here:
        del sys.path[0]
    try:
        module = importlib.import_module("grpo_cli.commands." + COMMANDS[command][0])
        sys.argv = [f"grpo {command}", *rest]
        module.main()
    except KeyboardInterrupt:  # Ctrl-C while importing or composing, before a command's own handling
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
