"""Bounds on what any admitted client can do to the model: its weight and its update's size.

An authenticated client is not a trusted one. Its update's weight in a weighted mean is the
``num_examples`` it claims, so the claim is bounded twice: by what the client reported at
Join (which selection already used) and by ``max_num_examples``. An update that claims more
than the client reported at Join is *refused* (INVALID_ARGUMENT naming both numbers), not
capped: capping silently would aggregate a weight the client never sent, and an honest
client never claims more than it holds. An evaluation's count is bounded by
``max_num_examples`` only: a client's test set may be larger than its training set.

``max_update_norm`` (0: off) bounds the L2 norm of an update's difference from the round's
global model, over its floating tensors, accumulated in float64 as each tensor completes so
that an upload over the bound is refused before the rest of it is read. The norm bound also
bounds magnitudes: no coordinate of an accepted update is further than the bound from the
global model. With it off, finite but huge updates can still overflow an aggregate; the
round engine never commits a non-finite one (``server/engine.py``).

``RemoteFleet`` (``server/uploads.py``) and ``InProcessFleet`` apply the same bounds, through
the same functions (``fleet/protocol.py``), so a simulated run refuses what a deployment would.
A difference kept as such (``FitRes.delta``) is measured as received, not against ``base``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from fedgrid.constants import MAX_NUM_EXAMPLES
from fedgrid.errors import InvalidUpdateError
from fedgrid.textsafe import escape

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["UpdateBounds", "UpdateNorm", "build_bounds"]

#: Elements converted to float64 at a time when measuring a norm (8 MiB of scratch).
_NORM_SLICE = 1 << 20


@dataclass(frozen=True)
class UpdateBounds:
    """The limits every update must stay within.

    Args:
        max_num_examples: largest ``num_examples`` a Join may report or an update claim.
        max_update_norm: largest L2 norm of an update's difference from the global model; 0: no bound.

    Raises:
        ValueError: a negative or non-finite bound.
    """

    max_num_examples: int = MAX_NUM_EXAMPLES
    max_update_norm: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_examples < 1:
            raise ValueError(f"max_num_examples must be at least 1, got {self.max_num_examples}")
        if not (math.isfinite(self.max_update_norm) and self.max_update_norm >= 0):
            raise ValueError(
                f"max_update_norm must be a finite number at least 0, got {self.max_update_norm}"
            )

    def check_join(self, num_examples: int) -> None:
        """Raises ``InvalidUpdateError`` unless ``0 <= num_examples <= max_num_examples``."""
        if not 0 <= num_examples <= self.max_num_examples:
            raise InvalidUpdateError(
                f"num_examples: {num_examples} reported at join, must be in 0..{self.max_num_examples}"
            )

    def check_claim(self, claimed: int, *, joined: int, evaluate: bool = False) -> None:
        """Raises ``InvalidUpdateError`` when an update's (or evaluation's) ``num_examples`` is over its bound.

        Args:
            claimed: the result's ``num_examples``.
            joined: what the client reported at Join (bounds fit updates only).
            evaluate: the result is an evaluation (bounded by ``max_num_examples`` alone).
        """
        if claimed > self.max_num_examples:
            raise InvalidUpdateError(
                f"num_examples: {claimed} claimed, over the maximum of {self.max_num_examples}"
            )
        if not evaluate and claimed > joined:
            raise InvalidUpdateError(
                f"num_examples: the update claims {claimed}, the client reported {joined} at join"
            )

    def norm(self, base: Mapping[str, torch.Tensor]) -> "UpdateNorm | None":
        """A meter of one update's norm against ``base``, or ``None`` when the bound is off."""
        return UpdateNorm(base, self.max_update_norm) if self.max_update_norm > 0 else None

    def check_update(self, update: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> None:
        """Checks a whole update's norm (the same rule ``UpdateNorm`` applies tensor by tensor)."""
        meter = self.norm(base)
        if meter is not None:
            for name, value in update.items():
                meter.add(name, value)


class UpdateNorm:
    """The running L2 norm of one update's difference from ``base``, checked against ``bound``.

    Floating tensors only (integer and bool tensors such as step counters are whole values,
    not model directions); complex tensors count their real and imaginary parts.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], bound: float) -> None:
        self.base, self.bound = base, bound
        self.squares = 0.0  # float64: 3e38 squared is far inside its range

    @property
    def value(self) -> float:
        """The norm of the tensors added so far."""
        return math.sqrt(self.squares)

    def add(self, name: str, value: torch.Tensor, *, difference: bool = False) -> None:
        """Adds tensor ``name``: its reconstructed value, or with ``difference`` its difference
        from ``base`` as received (then ``base`` is not read).

        Raises:
            InvalidUpdateError: the norm so far is over the bound (it names both).
        """
        if not (value.dtype.is_floating_point or value.dtype.is_complex) or not value.numel():
            return
        mine = value.detach().reshape(-1)
        theirs = None if difference else self.base[name].detach().reshape(-1).to(value.device)
        if value.dtype.is_complex:
            mine = torch.view_as_real(mine).reshape(-1)
            theirs = None if theirs is None else torch.view_as_real(theirs).reshape(-1)
        for start in range(0, mine.numel(), _NORM_SLICE):
            diff = mine[start : start + _NORM_SLICE].double()
            if theirs is not None:
                diff = diff - theirs[start : start + _NORM_SLICE].double()
            self.squares += float(torch.dot(diff, diff))
        if not self.value <= self.bound:  # also refuses a NaN norm
            raise InvalidUpdateError(
                f"update norm {self.value:.6g} is over max_update_norm {self.bound:.6g} (L2 norm of the difference "
                f"from the round's global model, floating tensors up to {escape(name)})"
            )


def build_bounds(config: "Config") -> UpdateBounds:
    """The bounds of a run's configuration (``max_num_examples``, ``max_update_norm``)."""
    return UpdateBounds(max_num_examples=config.max_num_examples, max_update_norm=config.max_update_norm)
