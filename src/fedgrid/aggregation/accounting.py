"""Privacy accounting of DP-FedAvg rounds with Google's ``dp-accounting`` (the ``privacy`` extra).

A round that aggregates the clipped updates of a share ``q`` of the clients, with Gaussian noise
of ``noise_multiplier`` times the clip on their sum, is a Poisson-subsampled Gaussian mechanism
(``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``). ``Accountant`` keeps the run's rounds as
run-length groups ``[q, sigma, count]`` (its state, checkpointed with the run) and computes the
``epsilon`` of a ``delta`` from them afresh with the chosen accountant: ``rdp`` (Renyi DP,
Mironov 2017, the library's default orders) or ``pld`` (privacy loss distributions, tighter).
An epsilon is a function of the groups alone, so a resumed run, rebuilt from its checkpoint,
computes the very same numbers as the run it continues (no incremental state to drift).

The sampling rate is the round's real participation (the results aggregated over the clients
live), not a planned fraction; the accountants assume Poisson sampling, the standard
approximation for a uniformly sampled cohort (docs/privacy.rst).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Mapping

__all__ = ["Accountant", "epsilon_of", "calibrate_noise_multiplier", "ACCOUNTANT_KINDS"]

ACCOUNTANT_KINDS = ("rdp", "pld")
#: A round group: (sampling rate q, noise multiplier sigma, rounds).
Group = tuple[float, float, int]


class _QuietOrders(logging.Filter):
    """Drops dp-accounting's warning that a fractional RDP order did not converge (that order is
    left out of the minimum, which stays an upper bound): one line per order and round otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


def _import() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover - the config check names the extra first
        raise ImportError(
            "differential privacy needs the dp-accounting package: pip install 'fedgrid[privacy]'"
        ) from None
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _QuietOrders) for f in absl.filters):
        absl.addFilter(_QuietOrders())
    return dp_accounting


@functools.lru_cache(maxsize=256)
def epsilon_of(kind: str, groups: tuple[Group, ...], delta: float) -> float:
    """The epsilon of ``delta`` after the rounds of ``groups``, by accountant ``kind``; 0 for none.

    Raises:
        ValueError: an unknown ``kind``, or a group out of range (``q`` in [0, 1], ``sigma`` > 0).
    """
    if kind not in ACCOUNTANT_KINDS:
        raise ValueError(f"unknown accountant {kind!r} (known: {', '.join(ACCOUNTANT_KINDS)})")
    dpa = _import()
    accountant = (
        dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()
    )  # fresh: the same groups always give the same bits
    composed = False
    for q, sigma, count in groups:
        if not (0.0 <= q <= 1.0) or not (sigma > 0 and math.isfinite(sigma)) or count < 1:
            raise ValueError(
                f"a round group needs q in [0, 1], sigma > 0, count >= 1; got {(q, sigma, count)}"
            )
        if q == 0.0:
            continue  # nobody's data was used: no privacy spent
        event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
        accountant.compose(dpa.SelfComposedDpEvent(event, count))
        composed = True
    return float(accountant.get_epsilon(delta)) if composed else 0.0


def calibrate_noise_multiplier(
    *, epsilon: float, delta: float, q: float, rounds: int, kind: str = "rdp", tol: float = 1e-3
) -> float:
    """The smallest noise multiplier (within ``tol``) whose ``rounds`` rounds at sampling rate ``q``
    spend at most ``epsilon`` at ``delta`` (dp-accounting's ``calibrate_dp_mechanism``).

    Raises:
        ValueError: ``epsilon`` not above 0, ``q`` not in (0, 1], or ``rounds`` below 1.
    """
    if not epsilon > 0 or not 0 < q <= 1 or rounds < 1:
        raise ValueError(f"needs epsilon > 0, q in (0, 1], rounds >= 1; got {epsilon}, {q}, {rounds}")
    dpa = _import()
    accountant = dpa.rdp.RdpAccountant if kind == "rdp" else dpa.pld.PLDAccountant

    def event(sigma: float) -> Any:
        return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), rounds)

    guess = dpa.LowerEndpointAndGuess(0.1, 1.0)
    return float(dpa.calibrate_dp_mechanism(accountant, event, epsilon, delta, guess, tol=tol))


class Accountant:
    """The privacy spent by a run's rounds (module docstring).

    Args:
        kind: ``rdp`` or ``pld``.
        delta: the delta of the epsilons reported.
    """

    def __init__(self, kind: str, delta: float) -> None:
        if kind not in ACCOUNTANT_KINDS:
            raise ValueError(f"unknown accountant {kind!r} (known: {', '.join(ACCOUNTANT_KINDS)})")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.kind = kind
        self.delta = delta
        self.groups: list[Group] = []

    @property
    def rounds(self) -> int:
        """The rounds accounted for."""
        return sum(count for _, _, count in self.groups)

    def _with(self, q: float, sigma: float) -> tuple[Group, ...]:
        groups = list(self.groups)
        if groups and groups[-1][:2] == (q, sigma):
            groups[-1] = (q, sigma, groups[-1][2] + 1)
        else:
            groups.append((q, sigma, 1))
        return tuple(groups)

    def epsilon(self) -> float:
        """The epsilon spent so far."""
        return epsilon_of(self.kind, tuple(self.groups), self.delta)

    def epsilon_after(self, q: float, sigma: float) -> float:
        """The epsilon one more round of rate ``q`` and noise multiplier ``sigma`` would bring the run to."""
        return epsilon_of(self.kind, self._with(q, sigma), self.delta)

    def spend(self, q: float, sigma: float) -> float:
        """Records a round of rate ``q`` and noise ``sigma``; returns the epsilon spent with it."""
        groups = self._with(q, sigma)
        epsilon = epsilon_of(self.kind, groups, self.delta)  # checks the group before it is kept
        self.groups = list(groups)
        return epsilon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "delta": self.delta, "groups": [list(g) for g in self.groups]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The rounds of a checkpoint (a resume keeps the budget spent).

        Raises:
            ValueError: a checkpoint of another accountant or delta (its epsilons would not be
                this run's), or malformed groups.
        """
        if state.get("kind") != self.kind or state.get("delta") != self.delta:
            raise ValueError(
                f"the checkpoint's privacy was accounted by {state.get('kind')!r} with delta "
                f"{state.get('delta')!r}, this run asks for {self.kind!r} with delta {self.delta!r}"
            )
        groups = [(float(q), float(sigma), int(count)) for q, sigma, count in state.get("groups", [])]
        epsilon_of(self.kind, tuple(groups), self.delta)  # refuses a malformed group now
        self.groups = groups
