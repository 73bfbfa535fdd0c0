"""Where the batched engine pays and how many clients fit at once: ``choose_engine`` (what
``auto`` picks), ``memory_budget`` (bytes it may use) and ``out_of_memory`` (whether an error
says an allocation failed, which halves K). Part of the batched engine
(``fedgrid.simulation.batched``).
"""

from __future__ import annotations

import os

import torch

__all__ = ["choose_engine", "memory_budget", "out_of_memory"]


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed: CUDA's ``torch.OutOfMemoryError``, or the
    CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory") or a ``MemoryError``."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text or "not enough memory" in text
    )


def choose_engine(*, device: torch.device, conv_share: float) -> tuple[str, str]:
    """The engine ``auto`` picks for a batchable model: ``(engine, reason)``.

    On CUDA, batched: one kernel per layer for K clients replaces K small ones, and small
    models leave a GPU idle otherwise. On CPU, batched for models whose training FLOPs are
    mostly matmuls (a per-client loop of small matmuls is dominated by per-step Python and
    dispatch overhead, which batching removes), sequential when convolutions carry most of
    the FLOPs (``conv_share > 0.5``): a per-client loop already keeps the cores busy in
    convolution kernels, and batched convolutions churn large temporary buffers (issue 6
    measured a batched CNN slower than the loop on 2 cores).
    """
    if device.type == "cuda":
        return "batched", "CUDA device"
    if conv_share > 0.5:
        return (
            "sequential",
            f"convolutions carry {conv_share:.0%} of the model's FLOPs, which batching does not speed up on CPU",
        )
    return "batched", "matmul-dominated model"


def memory_budget(device: torch.device) -> int:
    """Bytes the batched engine may use: 80% of free CUDA memory; on CPU min(2 GiB, 1/4 of available memory).

    Free CUDA memory counts what torch's caching allocator holds but no tensor uses
    (``memory_reserved - memory_allocated``): the device reports it as taken, yet the next
    chunk reuses it, so K does not shrink after the first round.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + max(cached, 0)) * 0.8)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return min(2 << 30, available // 4)
