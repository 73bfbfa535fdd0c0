"""Detects what a client reports at Join: its training device, accelerators and memory.

``detect_capabilities(device)`` looks at the device a client trains on:

- a CUDA device: ``num_accelerators`` is ``torch.cuda.device_count()`` (the GPUs this
  process may use, after ``CUDA_VISIBLE_DEVICES``) and ``memory_bytes`` the total memory of
  the training GPU (``torch.cuda.get_device_properties``), or of the smallest visible one
  when the device names no index: what one replica of the model has, which is what bounds
  the block BCD's ``capacity`` schedule can give it;
- any other device (``cpu``, ``mps``, ...): no accelerator counted and the host's memory,
  ``SC_PHYS_PAGES * SC_PAGE_SIZE``, or the container's cgroup memory limit when that is
  smaller (``/sys/fs/cgroup/memory.max``, cgroup v2; ``memory.limit_in_bytes``, v1).

Detection never fails a client: what cannot be read counts as 0. A view that is wrong
anyway (a limit enforced outside the cgroup, GPUs meant for something else) is corrected
with ``CapabilityOverride`` (``Client.capability_override``; ``fedgrid client
--report-device/--report-accelerators/--report-memory``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from fedgrid.capabilities import (
    MAX_ACCELERATORS,
    MAX_MEMORY_BYTES,
    Capabilities,
    CapabilityOverride,
    parse_size,
)
from fedgrid.config import Config

__all__ = ["detect_capabilities", "host_memory_bytes", "override_from", "CGROUP_LIMIT_FILES"]

log = logging.getLogger(__name__)

#: Where a container's memory limit is read (cgroup v2, then v1); "max" or a huge value: none.
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes(limit_files: tuple[str, ...] = CGROUP_LIMIT_FILES) -> int:
    """The host's physical memory, or the first cgroup limit in ``limit_files`` when smaller; 0 if unknown."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        physical = 0
    for name in limit_files:
        try:
            text = Path(name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) and (physical == 0 or int(text) < physical):
            physical = int(text)
        break  # the first file that exists is this host's hierarchy
    return min(max(physical, 0), MAX_MEMORY_BYTES)


def detect_capabilities(device: Any = None) -> Capabilities:
    """The capabilities of a client training on ``device`` (a ``torch.device``, a string such as
    ``"cuda:1"``, or ``None`` for the CPU); see the module docstring."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return Capabilities(device=dev.type, num_accelerators=0, memory_bytes=host_memory_bytes())
    try:
        count = torch.cuda.device_count()
        indices = [dev.index] if dev.index is not None else list(range(count))
        memory = min((torch.cuda.get_device_properties(i).total_memory for i in indices), default=0)
    except (RuntimeError, AssertionError) as exc:  # a CUDA device named on a host whose driver is gone
        log.warning("cannot read the CUDA devices (%s): reporting 0 accelerators and 0 bytes", exc)
        count, memory = 0, 0
    return Capabilities(
        device="cuda",
        num_accelerators=min(count, MAX_ACCELERATORS),
        memory_bytes=min(memory, MAX_MEMORY_BYTES),
    )


def override_from(config: Config) -> CapabilityOverride:
    """What ``config``'s ``report_device``, ``report_accelerators`` and ``report_memory`` state
    (``fedgrid client``'s flags and ``--config`` file); the keys left empty are detected."""
    return CapabilityOverride(
        device=config.report_device or None,
        num_accelerators=config.report_accelerators,
        memory_bytes=parse_size(config.report_memory, what="report_memory") if config.report_memory else None,
    )
