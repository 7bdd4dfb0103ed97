"""What one step asked of the device: its peak memory (CUDA: tensors and what the caching allocator
holds; CPU: the process's peak resident set), and a wait for the device's queued work, so that a timer or
a memory probe read next counts it."""

from __future__ import annotations

import resource

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    """Wait until the GPU has run the work queued so far, so that a timer read next counts it (CUDA kernels
    run asynchronously: without this a step's time is when its last kernel was queued). Nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak-memory count (CUDA); nothing on CPU (`peak_memory_mb` is the process's peak there)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def step_memory(device: torch.device) -> dict:
    """`memory/peak_allocated_gb` (tensors) and `memory/peak_reserved_gb` (held by PyTorch's caching allocator,
    what other processes cannot use) since `reset_peak_memory`, on CUDA; {} on CPU."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
