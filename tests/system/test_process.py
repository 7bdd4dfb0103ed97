"""What a fresh `grpo` process is: importing the CLI loads no torch, and its heap serves activation-sized blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_heap_serves_activation_sized_blocks_and_maps_the_large_ones():
    # the CLI's mmap threshold (64 MiB): a 6 MiB tensor comes from the heap (reused, no page faults on every
    # allocation), a 128 MiB one is mapped (and goes back to the OS when freed); glibc's own threshold would have
    # mapped the 6 MiB one too at start-up
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, check=True)
    mapped = int(out.stdout.split()[-1])
    assert 128 * 2**20 <= mapped < 128 * 2**20 + 6 * 2**20
