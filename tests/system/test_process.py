"""What a fresh `grpo` process is: importing the CLI loads no torch, its heap serves activation-sized blocks, and a
default run's console holds our lines only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo_cli.rollout import engine
from tests.helpers import REPO
from tests.helpers.engines import needs_vllm


def test_importing_the_cli_does_not_load_torch():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import sys, grpo_cli.cli; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


HEAP_PROBE = """
import ctypes, sys

class Info(ctypes.Structure):  # glibc's struct mallinfo2: arena, ordblks, smblks, hblks, hblkhd, ...
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
from grpo_cli.cli import limit_heap_growth
assert limit_heap_growth()
import torch
mapped = libc.mallinfo2().hblkhd
activation = torch.ones(1024, 1536)          # 6 MiB: a length bucket's MLP activation
big = torch.ones(128 * 2**20 // 4)           # 128 MiB: over the threshold
print(libc.mallinfo2().hblkhd - mapped)
"""


@pytest.mark.slow  # a fresh interpreter's heap (~3 s, torch imported): make test-ci
@pytest.mark.ci
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_heap_serves_activation_sized_blocks_and_maps_the_large_ones():
    # the CLI's mmap threshold (64 MiB): a 6 MiB tensor comes from the heap (reused, no page faults on every
    # allocation), a 128 MiB one is mapped (and goes back to the OS when freed); glibc's own threshold would have
    # mapped the 6 MiB one too at start-up
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True)
    mapped = int(out.stdout.split()[-1])
    assert 128 * 2**20 <= mapped < 128 * 2**20 + 6 * 2**20


# every line a default `grpo train` prints (stdout and stderr together, piped to a file)
OUR_LINES = [r"sampler: vLLM \(installed; sampler=default for HF generate\)", r"run dir: \S+",
             r"train ━+ 1/1 \d+:\d\d:\d\d eta \d+:\d\d:\d\d reward \S+  kl \S+  loss \S+  len \S+",
             r"checkpoint: \S+/step_000001", r"curves: \S+training\.png",
             # the default job's in-run eval (trainer.eval_every) at its last step, on 4 problems here
             r"step 1: held-out accuracy \S+ \(\S+-\S+, 4 problems\), reward \S+, length \S+"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.ci
def test_a_default_run_with_vllm_prints_our_lines_only(tmp_path):
    """A fresh `grpo train` (the default sampler: vLLM, installed here; a fresh matplotlib cache) on the embedded
    model, one tiny step and its eval: its console holds no library's warning, log line or progress bar, and the bar is
    whole."""
    import os
    import re

    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", engine.OPT_OUT, "COLUMNS")}
    env["MPLCONFIGDIR"] = str(tmp_path / "matplotlib")  # matplotlib builds its font cache: its INFO line would print
    tiny = ["trainer.max_steps=1", "trainer.prompts_per_step=1", "algo.group_size=2", "sampler.max_new_tokens=8",
            "trainer.eval_size=4"]
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", *tiny, f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert out.returncode == 0, out.stdout[-3000:]
    assert [line for line in lines if not any(re.fullmatch(p, line) for p in OUR_LINES)] == [], out.stdout
    assert len(lines) == len(OUR_LINES), out.stdout
