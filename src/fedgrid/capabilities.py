"""What a client reports of its hardware at Join, the bounds a coordinator holds it to, and
memory sizes as people write them.

A client reports its training device type (``cpu``, ``cuda``, ``mps``, ...), its accelerator
count and the memory one training process has (``client/capabilities.py`` detects them;
a client may state them instead). The coordinator selects clients by them
(``aggregation/selection.py``'s ``CapabilityFilter``) and BCD's ``capacity`` schedule ranks
clients by memory, so what a client reports is checked before it is believed
(``check_capabilities``): a device type is a short lowercase identifier, as torch names
device types, so that ``require_device = "cuda"`` compares exact strings and no report can
forge a log line; counts and sizes are within ``MAX_ACCELERATORS`` and ``MAX_MEMORY_BYTES``
(far above any machine, far below what would overflow a sum or mislead a ranking by orders of
magnitude).

``parse_size`` reads ``16GiB``, ``512M`` or a plain byte count: the ``min_client_memory`` and
``report_memory`` keys and the ``--report-memory`` flag take one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedgrid.errors import InvalidUpdateError
from fedgrid.textsafe import escape

__all__ = [
    "Capabilities",
    "CapabilityOverride",
    "check_capabilities",
    "parse_size",
    "format_size",
    "describe",
    "MAX_ACCELERATORS",
    "MAX_MEMORY_BYTES",
    "MAX_DEVICE_CHARS",
]

#: Most accelerators a client may report (a large node has 8 to 16).
MAX_ACCELERATORS = 1024
#: Most memory a client may report: 1 PiB (a large host has a few TiB).
MAX_MEMORY_BYTES = 1 << 50
#: Longest device type a client may report.
MAX_DEVICE_CHARS = 32

_DEVICE = re.compile(r"[a-z][a-z0-9_]*")
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "P": 10**15,
    "PB": 10**15,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "PIB": 1 << 50,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def check_capabilities(device: str, num_accelerators: int, memory_bytes: int) -> None:
    """Raises ``InvalidUpdateError`` naming the first of the three that breaks its rule (see the module docstring)."""
    if len(device) > MAX_DEVICE_CHARS or not _DEVICE.fullmatch(device):
        raise InvalidUpdateError(
            f"device: {escape(device)} is not a device type (lowercase letters, digits and '_', "
            f"starting with a letter, at most {MAX_DEVICE_CHARS} characters; e.g. 'cpu', 'cuda')"
        )
    if not 0 <= num_accelerators <= MAX_ACCELERATORS:
        raise InvalidUpdateError(
            f"num_accelerators: {num_accelerators} reported, must be in 0..{MAX_ACCELERATORS}"
        )
    if not 0 <= memory_bytes <= MAX_MEMORY_BYTES:
        raise InvalidUpdateError(
            f"memory_bytes: {memory_bytes} reported, must be in 0..{MAX_MEMORY_BYTES} (1 PiB)"
        )


@dataclass(frozen=True)
class Capabilities:
    """What a client reports at Join.

    Attributes:
        device: the type of the device it trains on (``cpu``, ``cuda``, ``mps``, ...).
        num_accelerators: the accelerators it may use (0 on a CPU host).
        memory_bytes: the memory one training process has: its accelerator's on a GPU,
            the host's (or its container's limit) on CPU.

    Raises:
        ValueError: a value ``check_capabilities`` refuses (the message names it), so a
            client finds out before the coordinator refuses its Join.
    """

    device: str = "cpu"
    num_accelerators: int = 0
    memory_bytes: int = 0

    def __post_init__(self) -> None:
        try:
            check_capabilities(self.device, self.num_accelerators, self.memory_bytes)
        except InvalidUpdateError as exc:
            raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class CapabilityOverride:
    """Capabilities a client states in place of detected ones, field by field (``None``:
    the detected value): a container sees the host's memory, not its own limit, and a
    client may be meant to use fewer GPUs than it sees."""

    device: str | None = None
    num_accelerators: int | None = None
    memory_bytes: int | None = None

    def apply(self, detected: Capabilities) -> Capabilities:
        """``detected`` with the stated fields in place of its own.

        Raises:
            ValueError: a stated value out of bounds (see ``Capabilities``).
        """
        return Capabilities(
            device=detected.device if self.device is None else self.device,
            num_accelerators=detected.num_accelerators
            if self.num_accelerators is None
            else self.num_accelerators,
            memory_bytes=detected.memory_bytes if self.memory_bytes is None else self.memory_bytes,
        )


def parse_size(text: str, *, what: str = "size") -> int:
    """Bytes of ``text``: a byte count, or a number with a unit (``K`` ... ``P`` and ``KB`` ...
    ``PB`` are powers of 1000, ``KiB`` ... ``PiB`` powers of 1024; case-insensitive).

    Raises:
        ValueError: not a size, or over ``MAX_MEMORY_BYTES`` (the message names ``what``).
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{what}: {text!r} is not a size (e.g. 16GiB, 512MB or a byte count)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value > MAX_MEMORY_BYTES:
        raise ValueError(
            f"{what}: {text!r} is over the most a client may report, {format_size(MAX_MEMORY_BYTES)}"
        )
    return value


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1 (``16.0 GiB``)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def describe(device: str, num_accelerators: int, memory_bytes: int) -> str:
    """``cuda x2, 80.0 GiB memory``: a report in a few words (a count or size of 0, unknown, left out)."""
    return (
        device
        + (f" x{num_accelerators}" if num_accelerators else "")
        + (f", {format_size(memory_bytes)} memory" if memory_bytes else "")
    )
