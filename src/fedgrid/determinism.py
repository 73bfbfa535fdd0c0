"""What makes two runs produce the same bits, and the knobs that pin it.

The contract (the README's "Determinism" section says the same to users):

- **Bit-identical** are two runs with the same configuration and seed, the same surviving
  clients, the same torch build, the same intra-op thread count (``threads``) and the same
  engine: a deployment (coordinator plus client processes) and ``fedgrid simulate
  --engine sequential``; a deployment killed or stopped any number of times and an
  uninterrupted one; a run and its rerun from the run directory's ``config.toml``;
  overlapped DiLoCo (``sync_delay_steps`` > 0) deployed and simulated, since its merge
  happens at a step number, never at an arrival time (``fedgrid.aggregation.diloco``).
- **Not reproducible**: a run with ``inner_time_s`` > 0, whose workers run as many inner
  steps as fit in a time budget.
  Updates are aggregated in a canonical order (the order of the assignments, never the
  order of arrival), so network timing never enters the arithmetic.
- **Different bits** come from a different intra-op thread count (torch splits a matmul's
  or a reduction's accumulation across threads, and float addition is not associative:
  on the digits MLP, 1 and 2 threads differ by about 1e-7 after a few rounds on AMD EPYC),
  from another torch build or CPU kind (other kernels), and from the batched engine.
- **Within a tolerance**: the batched engine (``--engine batched``, and ``auto`` where it
  picks it) against the sequential one. It computes every client's step as one batched
  matmul over stacked parameters (``torch.func.vmap``), whose kernels accumulate in a
  different order than a per-client matmul; the rounding differences compound over local
  steps. ``BATCHED_ATOL`` (1e-5) is the bound the tests hold it to, about a hundred times
  what was measured on the digits MLP (10 clients, 2 local epochs, SGD with momentum):
  3e-8 after 3 rounds, 1.2e-7 after 10, with 1 or 2 threads; the margin covers longer runs
  and other CPUs without hiding a real divergence, which shows up as 1e-3 or more.
"""

from __future__ import annotations

import contextlib
import platform
import sys
from typing import Any, Iterator

import torch

__all__ = ["BATCHED_ATOL", "MAX_THREADS", "intra_op_threads", "environment"]

#: Largest absolute difference allowed between the batched and the sequential engine's
#: final model on the tests' runs (float32 parameters of order 0.1-1).
BATCHED_ATOL = 1e-5
#: Largest accepted ``threads`` value.
MAX_THREADS = 1024


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[int]:
    """Runs the block with ``torch.set_num_threads(threads)`` and restores the previous count.

    Args:
        threads: intra-op threads; 0 keeps torch's current count (its default: one per
            core, or ``OMP_NUM_THREADS``).

    Yields:
        The thread count in force inside the block.

    Raises:
        ValueError: ``threads`` is negative or above ``MAX_THREADS``.
    """
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be in 0..{MAX_THREADS}, got {threads}")
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if threads:
            torch.set_num_threads(before)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(**extra: Any) -> dict[str, Any]:
    """What a run's bits depend on beyond its configuration, for ``config.toml``'s
    ``[environment]`` table: torch's version, Python's, the CPU, the thread count now in
    force, plus ``extra``."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "cpu": _cpu(),
        "threads": torch.get_num_threads(),
        **extra,
    }
