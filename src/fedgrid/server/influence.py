"""What one admitted client can do to a round: its weight is capped, and an update far from
the others, or pointing away from them, is refused.

A certificate proves who a client is, not that it is honest. Three rules run on every fit
round's results once the round has closed, in the round engine (``RoundEngine._fit``), so
every fleet (``RemoteFleet``, the simulated fleets, a replay, a region's) applies them the
same way, to the same results, with the same bits:

1. **Distance.** Each update's L2 distance from the model its task sent (``base``; a late
   result's own task model; floating tensors, in float64, ``bounds.UpdateNorm``) is compared
   with the round's *reference*: the lower median distance of the round's *fresh* updates
   (trained from the round's own model) of the same tensors. An update
   farther than ``max_update_ratio`` times that median is refused: it becomes its client's
   ``Failure`` for the round, naming both numbers. This stops a scaled update (x1e3) and a
   finite model of 3e38 values, which per-update checks accept. Updates of other tensors (a
   block-coordinate client training another block) are compared among themselves. A late
   result (``--min-quorum``) is compared with the median of the fresh updates of *its own
   task's* round (``references``, kept with the checkpoint): updates trained from the same
   model, not the smaller steps of a later one (a result two rounds stale from early training
   stepped 12x as far as the fresh one it was measured against, and was refused), or, when that
   round is no longer kept, with the merging round's reference. A late result never sets the
   reference of the round it merges into (two late results once set it, and both fresh honest
   updates of that round were refused). A group with fewer than ``MIN_FRESH_UPDATES`` fresh
   updates takes the latest kept round's reference (the fallback; with none kept, the lone
   update's own distance); a group with no fresh update and no kept reference is not measured.
2. **Direction and spread.** In a tensor group of at least ``MIN_DIRECTION_UPDATES`` fresh
   updates, the round's *median update* is the coordinate-wise lower median of the fresh updates'
   differences (``server/direction.py``). An update (fresh or late) whose cosine with it is under
   ``min_update_cosine`` points away from where the round goes, and one farther from it than
   ``max_deviation_ratio`` times the lower median of the fresh updates' distances from it lies
   apart from them: each is refused, its client's ``Failure`` naming the numbers. A constant
   model within the distance rule's range (one client of three, half a round's weight at the
   share cap) is refused by one or the other in every round after the first; honest non-IID
   updates (digits, every strategy and codec, ``dirichlet:0.1``) were never refused
   (docs/failures.rst gives the numbers and the trade-off for label-disjoint clients).
3. **Weight.** The claims (``num_examples``) of the updates left are capped: a claim counts
   for at most its identity's quota (``client_quotas``, for a cross-silo federation whose
   sizes are known) and at most ``max_weight_ratio`` times the round's lower median claim
   (after quotas). A claim over its cap counts as the cap: ``FitRes.num_examples`` is
   replaced, so every weighted mean, the staleness weight of a late result, the weighted
   train loss and a region's examples upstream all read the capped count. A claim of 10**9
   then buys exactly what a claim of 10**8 buys.

The claims' median is taken over the results in hand when the round closes (fresh results and
the late ones merged into it), the distances' over the fresh ones, neither over the claims made
at Join: the set a round aggregates is
what the determinism contract fixes, so the caps do not depend on arrival order or on who
joined. The *lower* median (``statistics.median_low``) is an actual client's value: with two
clients it is the smaller, so one client of two can neither inflate the reference nor hide
behind it. An honest majority keeps the median honest; attackers who are the majority of a
round own it whatever the rule.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Mapping

import tomllib
import torch

from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.events import EventLog
from fedgrid.fleet.base import LateResult, RoundOutcome
from fedgrid.fleet.bounds import UpdateNorm
from fedgrid.server.direction import median_geometry
from fedgrid.textsafe import escape
from fedgrid.types import Failure, FitRes

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = [
    "Influence",
    "build_influence",
    "load_quotas",
    "share_caps",
    "update_distance",
    "CLAIMS_CAPPED",
    "UPDATES_REFUSED",
]

log = logging.getLogger(__name__)

#: ``RoundMetrics.extra`` keys: claims counted at their cap, updates refused as too far (when non-zero).
CLAIMS_CAPPED = "claims_capped"
UPDATES_REFUSED = "updates_refused"
#: Defaults of ``max_weight_ratio`` and ``max_update_ratio``: generous enough for honest
#: differences in data size and drift, small enough that one client is never the whole mean.
DEFAULT_WEIGHT_RATIO = 10.0
DEFAULT_UPDATE_RATIO = 10.0
#: Default of ``min_update_cosine``: under what honest updates reached (digits, 10 clients:
#: -0.14 at dirichlet:0.1, -0.30 at shards:2, -0.08 under qsgd and sparseloco, -0.42 in bcd's
#: converged rounds), over what a constant model of one client of three reached the round after
#: it pulled (-0.52 to -0.80). A thin margin: docs/failures.rst.
DEFAULT_UPDATE_COSINE = -0.5
#: Default of ``max_deviation_ratio``: honest updates' distances from the round's median update
#: stayed within 2.05x of the lower median one (digits, 10 clients, every strategy, codec and
#: partition measured); a constant model's reached 4.2x.
DEFAULT_DEVIATION_RATIO = 3.0
#: Fresh updates of a tensor group a round needs for the direction check: of two, the median
#: is their mean, and two parties cannot tell which one lies.
MIN_DIRECTION_UPDATES = 3
#: Default of ``max_weight_share``: no identity holds the majority of a round's weight.
DEFAULT_WEIGHT_SHARE = 0.5
#: Identities a round needs for ``max_weight_share`` to apply (``share_caps``).
MIN_SHARED_IDENTITIES = 3
#: Rounds whose references are kept: a late result staler than this is measured against its
#: merging round's median (``max_staleness`` defaults to 4).
REFERENCE_ROUNDS = 256
#: Fresh updates of a tensor group below which a round takes the latest kept round's reference
#: for it (``Influence._remember``): one update's distance says nothing of what is normal.
MIN_FRESH_UPDATES = 2


@dataclass(frozen=True)
class Influence:
    """The caps on one round's results (module docstring).

    Args:
        max_weight_ratio: a claim counts for at most this times the round's lower median
            claim; 0: no ratio cap.
        client_quotas: identity (``ClientInfo.name``) -> the most examples its claim counts
            for; identities not listed have the ratio cap only.
        max_update_ratio: an update farther from its task's model than this times the round's
            lower median distance is refused; 0: off.
        max_weight_share: no identity's claims count for more than this share of the round's
            weight (after the caps above; a share under an equal one is an equal one); 0: off.
        min_update_cosine: an update whose cosine with the coordinate-wise median of the round's
            fresh updates (of its tensors, at least ``MIN_DIRECTION_UPDATES`` of them) is under
            this is refused; -1: off.
        max_deviation_ratio: an update farther from that median update than this times the
            lower median of the fresh updates' distances from it is refused; 0: off.

    Raises:
        ValueError: a ratio that is not 0 or a finite number at least 1, a share outside
            (0, 1] other than 0, a cosine outside [-1, 1], or a quota below 1.
    """

    max_weight_ratio: float = DEFAULT_WEIGHT_RATIO
    client_quotas: Mapping[str, int] = field(default_factory=dict)
    max_update_ratio: float = DEFAULT_UPDATE_RATIO
    max_weight_share: float = DEFAULT_WEIGHT_SHARE
    min_update_cosine: float = DEFAULT_UPDATE_COSINE
    max_deviation_ratio: float = DEFAULT_DEVIATION_RATIO
    #: Fit round -> its fresh updates' lower median distance by tensor group: the reference of
    #: that round's late results. The last ``REFERENCE_ROUNDS`` rounds; state of a run.
    references: dict[int, dict[frozenset[str], float]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key in ("max_weight_ratio", "max_update_ratio", "max_deviation_ratio"):
            value = getattr(self, key)
            if not (value == 0 or (math.isfinite(value) and value >= 1)):
                raise ValueError(f"{key} must be 0 (off) or a finite number at least 1, got {value}")
        if not 0 <= self.max_weight_share <= 1:
            raise ValueError(
                f"max_weight_share must be 0 (off) or a share in (0, 1], got {self.max_weight_share}"
            )
        if not -1 <= self.min_update_cosine <= 1:
            raise ValueError(
                f"min_update_cosine must be a cosine in [-1, 1] (-1: off), got {self.min_update_cosine}"
            )
        for name, quota in self.client_quotas.items():
            if isinstance(quota, bool) or not isinstance(quota, int) or quota < 1:
                raise ValueError(
                    f"client quota of {escape(name)} must be an integer at least 1, got {quota!r}"
                )

    @property
    def off(self) -> bool:
        return not (
            self.max_weight_ratio
            or self.client_quotas
            or self.max_update_ratio
            or self.max_weight_share
            or self.min_update_cosine > -1
            or self.max_deviation_ratio
        )

    def bound(
        self,
        server_round: int,
        outcome: RoundOutcome[FitRes],
        base: Mapping[str, torch.Tensor],
        *,
        events: EventLog | None = None,
    ) -> RoundOutcome[FitRes]:
        """``outcome`` with its far updates (fresh or late) refused, each its client's ``Failure``,
        and the claims of the rest capped; ``extra`` counts both when non-zero.

        Args:
            server_round: the round (for messages and events).
            outcome: the fleet's outcome of the round's fit phase.
            base: the state the round's tasks sent (``Strategy.downlink_state``).
            events: where ``update_refused`` and ``claim_capped`` go.
        """
        if self.off or not (outcome.results or outcome.late):
            return outcome
        fresh, late = list(outcome.results), list(outcome.late)
        refused: list[Failure] = []
        if self.max_update_ratio:
            fresh, late, refused = self._refuse_far(server_round, fresh, late, base, events)
        if self.min_update_cosine > -1 or self.max_deviation_ratio:
            fresh, late, away = self._refuse_away(server_round, fresh, late, base, events)
            refused += away
        fresh, late, count = self._cap_claims(server_round, fresh, late, events)
        extra = dict(outcome.extra)
        if count:
            extra[CLAIMS_CAPPED] = float(count)
        if refused:
            extra[UPDATES_REFUSED] = float(len(refused))
        return dataclasses.replace(
            outcome, results=fresh, late=late, failures=list(outcome.failures) + refused, extra=extra
        )

    def _cap_claims(
        self, server_round: int, fresh: list[FitRes], late: list[LateResult], events: EventLog | None
    ) -> tuple[list[FitRes], list[LateResult], int]:
        """``fresh`` and ``late`` with each claim over its cap replaced by the cap; how many were."""
        results = fresh + [item.result for item in late]
        if not results:
            return fresh, late, 0
        quotas = [self.client_quotas.get(r.client.name) for r in results]
        counted = [r.num_examples if q is None else min(r.num_examples, q) for r, q in zip(results, quotas)]
        limit = (
            math.floor(self.max_weight_ratio * statistics.median_low(counted)) if self.max_weight_ratio else 0
        )
        caps = [
            min(c for c in (q, limit or None, r.num_examples) if c is not None)
            for r, q in zip(results, quotas)
        ]
        shared = share_caps(caps, [_identity(r) for r in results], self.max_weight_share)
        count = 0
        for i, (res, quota) in enumerate(zip(results, quotas)):
            cap = min(caps[i], shared[i])
            if res.num_examples <= cap:
                continue
            count += 1
            if cap < caps[i]:
                why = f"max_weight_share {self.max_weight_share:g} of the round's weight"
            elif cap == quota:
                why = "its client_quotas entry"
            else:
                why = f"max_weight_ratio {self.max_weight_ratio:g} x the round's median claim"
            log.info(
                "round %d: client %s claims %d examples, counted as %d (%s)",
                server_round,
                escape(res.client.name or res.client.client_id),
                res.num_examples,
                cap,
                why,
            )
            if events is not None:
                events.emit(
                    "claim_capped",
                    round=server_round,
                    client=res.client.client_id,
                    name=res.client.name,
                    claimed=res.num_examples,
                    cap=cap,
                )
            capped = dataclasses.replace(res, num_examples=cap)
            if i < len(fresh):
                fresh[i] = capped
            else:
                late[i - len(fresh)] = dataclasses.replace(late[i - len(fresh)], result=capped)
        return fresh, late, count

    def _refuse_far(
        self,
        server_round: int,
        fresh: list[FitRes],
        late: list[LateResult],
        base: Mapping[str, torch.Tensor],
        events: EventLog | None,
    ) -> tuple[list[FitRes], list[LateResult], list[Failure]]:
        """The fresh and late results within ``max_update_ratio`` of their group's lower median
        distance, and the refused ones as failures."""
        measured: list[tuple[FitRes, float, frozenset[str]]] = [
            (r, update_distance(r, base), _part(r)) for r in fresh
        ] + [(item.result, update_distance(item.result, item.base), _part(item.result)) for item in late]
        # The round's reference comes from its fresh updates only: a late result never sets it.
        reference, borrowed = self._remember(server_round, measured[: len(fresh)])
        counts: dict[frozenset[str], int] = {}
        for _, _, part in measured[: len(fresh)]:
            counts[part] = counts.get(part, 0) + 1
        refused: dict[int, Failure] = {}
        for i, (res, distance, part) in enumerate(measured):
            task_round = late[i - len(fresh)].task_round if i >= len(fresh) else server_round
            if part in self.references.get(task_round, {}):
                # A late result: the fresh updates of its own task's round, trained from its model.
                median = self.references[task_round][part]
                if task_round != server_round:
                    against = f"the median distance {median:.6g} of round {task_round}'s fresh updates"
                elif part in borrowed:
                    against = (
                        f"the median distance {median:.6g} of round {borrowed[part]}'s fresh updates "
                        f"(this round has {counts.get(part, 0)}, under {MIN_FRESH_UPDATES})"
                    )
                else:
                    against = f"the round's median distance {median:.6g} ({counts[part]} fresh updates)"
            elif part in reference:
                # A late result whose task's round is no longer kept: the merging round's fresh updates.
                median = reference[part]
                against = f"the round's median distance {median:.6g}"
            else:
                continue  # no fresh update of these tensors anywhere to measure it against
            if distance <= self.max_update_ratio * median:
                continue
            reason = (
                f"update refused: its distance {distance:.6g} from its task's model is over "
                f"max_update_ratio {self.max_update_ratio:g} x {against}"
            )
            refused[i] = Failure(res.client, reason)  # the engine logs it with the round's failures
            if events is not None:
                events.emit(
                    "update_refused",
                    round=server_round,
                    client=res.client.client_id,
                    name=res.client.name,
                    distance=distance,
                    median=median,
                    ratio=self.max_update_ratio,
                )
        kept_fresh = [r for i, r in enumerate(fresh) if i not in refused]
        kept_late = [item for i, item in enumerate(late) if len(fresh) + i not in refused]
        return kept_fresh, kept_late, [refused[i] for i in sorted(refused)]

    def _refuse_away(
        self,
        server_round: int,
        fresh: list[FitRes],
        late: list[LateResult],
        base: Mapping[str, torch.Tensor],
        events: EventLog | None,
    ) -> tuple[list[FitRes], list[LateResult], list[Failure]]:
        """The fresh and late results whose cosine with the coordinate-wise median of their tensor
        group's fresh updates is at least ``min_update_cosine`` and whose distance from it is
        within ``max_deviation_ratio`` x the fresh updates' lower median distance from it (not
        measured where that is 0: two of three equal updates are no yardstick), and the refused
        ones as failures. A group with fewer than ``MIN_DIRECTION_UPDATES`` fresh updates is not
        measured; a late result is measured against the merging round's median (its own round's
        is not kept: a model's worth of memory a round)."""
        updates = [(r, base) for r in fresh] + [(item.result, item.base) for item in late]
        groups: dict[tuple[tuple[str, tuple[int, ...]], ...], list[int]] = {}
        for i, (res, _) in enumerate(updates):  # the same floating tensors, of the same shapes
            key = tuple(sorted((n, tuple(t.shape)) for n, t in res.state.items() if t.is_floating_point()))
            groups.setdefault(key, []).append(i)
        refused: dict[int, Failure] = {}
        for key, members in groups.items():
            own = [i for i in members if i < len(fresh)]
            names = [n for n, _ in key]
            if len(own) < MIN_DIRECTION_UPDATES or not names:
                continue
            rest = [i for i in members if i >= len(fresh)]
            geometry = median_geometry(
                names,
                [(updates[i][0].state, updates[i][1], updates[i][0].delta) for i in own],
                [(updates[i][0].state, updates[i][1], updates[i][0].delta) for i in rest],
            )
            if geometry is None:
                continue
            spread = statistics.median_low(geometry.deviations[: len(own)])
            for i, cosine, deviation in zip(own + rest, geometry.cosines, geometry.deviations):
                res = updates[i][0]
                if cosine < self.min_update_cosine:  # nan (no step at all): nothing to point away
                    why = (
                        f"it points away from the round's median update (cosine {cosine:.3g} "
                        f"with the coordinate-wise median of {len(own)} fresh updates, under "
                        f"min_update_cosine {self.min_update_cosine:g})"
                    )
                elif self.max_deviation_ratio and spread and deviation > self.max_deviation_ratio * spread:
                    why = (
                        f"its distance {deviation:.6g} from the round's median update (coordinate-wise, "
                        f"of {len(own)} fresh updates) is over max_deviation_ratio {self.max_deviation_ratio:g} "
                        f"x the fresh updates' median distance from it {spread:.6g}"
                    )
                else:
                    continue
                refused[i] = Failure(res.client, "update refused: " + why)
                if events is not None:
                    events.emit(
                        "update_refused",
                        round=server_round,
                        client=res.client.client_id,
                        name=res.client.name,
                        cosine=cosine,
                        deviation=deviation,
                        spread=spread,
                    )
        kept_fresh = [r for i, r in enumerate(fresh) if i not in refused]
        kept_late = [item for i, item in enumerate(late) if len(fresh) + i not in refused]
        return kept_fresh, kept_late, [refused[i] for i in sorted(refused)]

    def _remember(
        self, server_round: int, fresh: list[tuple[FitRes, float, frozenset[str]]]
    ) -> tuple[dict[frozenset[str], float], dict[frozenset[str], int]]:
        """Keeps and returns ``server_round``'s reference by tensor group: the lower median
        distance of its fresh updates, or, for a group with fewer than ``MIN_FRESH_UPDATES`` of
        them, the latest kept round's reference of that group (the fallback: a lone update is not
        its own yardstick), or, with none kept, the lone update's own distance. Also returns the
        groups that fell back, with the round each took its reference from."""
        groups: dict[frozenset[str], list[float]] = {}
        for _, distance, part in fresh:
            groups.setdefault(part, []).append(distance)
        reference: dict[frozenset[str], float] = {}
        borrowed: dict[frozenset[str], int] = {}
        for part, distances in groups.items():
            earlier = [
                r
                for r in sorted(self.references, reverse=True)
                if r < server_round and part in self.references[r]
            ]
            if len(distances) < MIN_FRESH_UPDATES and earlier:
                reference[part] = self.references[earlier[0]][part]
                borrowed[part] = earlier[0]
            else:
                reference[part] = statistics.median_low(distances)
        self.references[server_round] = reference
        for old in [r for r in self.references if r <= server_round - REFERENCE_ROUNDS]:
            del self.references[old]
        return reference, borrowed

    def state_dict(self) -> dict[str, Any]:
        """The references, for the checkpoint (``load_state_dict``)."""
        return {
            "references": [
                [r, [[sorted(part), median] for part, median in by_part.items()]]
                for r, by_part in sorted(self.references.items())
            ]
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The references of ``state_dict`` (none in a checkpoint written before they were kept)."""
        self.references.clear()
        for r, by_part in state.get("references", []):
            self.references[int(r)] = {frozenset(part): float(median) for part, median in by_part}


def _identity(res: FitRes) -> str:
    return res.client.name or res.client.client_id


def share_caps(weights: list[int], identities: list[str], share: float) -> list[int]:
    """Each weight's cap so that no identity holds more than ``share`` of the total: the
    identities over it are cut to one level ``T`` with ``T = share * (T * k + rest)`` (``k`` of
    them cut, ``rest`` the others' weight), each of their weights scaled by ``T`` over its
    identity's sum and rounded down (at least 1). A share under an equal one (``1 / n`` of
    ``n`` identities) cannot be met: it is raised to that. ``share`` 0 (off) or 1 caps nothing,
    and neither does a round of fewer than ``MIN_SHARED_IDENTITIES``: of two, the cap would
    make every round an unweighted mean (two regions of unequal sizes, two silos), and two
    parties cannot tell which one lies anyway; the ratio cap bounds them. Exact (``Fraction``):
    the same weights give the same caps on every machine.

    Returns:
        The caps, one per weight (a weight not cut is its own cap).
    """
    totals: dict[str, int] = {}
    for w, who in zip(weights, identities):
        totals[who] = totals.get(who, 0) + w
    if not share or share >= 1 or len(totals) < MIN_SHARED_IDENTITIES:
        return list(weights)
    cap = max(Fraction(share), Fraction(1, len(totals)))
    order = sorted(totals.values(), reverse=True)
    rest = sum(order)
    for k, top in enumerate(order, start=1):
        rest -= top
        if k * cap >= 1:  # every identity at an equal share: nobody over it
            return list(weights)
        level = cap * rest / (1 - k * cap)
        if k == len(order) or order[k] <= level:
            break
    if top <= level:  # nobody over the share
        return list(weights)
    return [
        max(1, math.floor(w * level / totals[who])) if totals[who] > level else w
        for w, who in zip(weights, identities)
    ]


def _part(res: FitRes) -> frozenset[str]:
    """The floating tensors ``res`` holds: updates of the same ones are compared."""
    return frozenset(n for n, t in res.state.items() if t.dtype.is_floating_point or t.dtype.is_complex)


def update_distance(res: FitRes, base: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of ``res``'s difference from ``base`` over its floating tensors (float64);
    a delta result's tensors (and a tensor ``base`` lacks) are taken as differences as they are."""
    meter = UpdateNorm(base, math.inf)
    try:
        for name, value in res.state.items():
            ref = base.get(name)
            meter.add(name, value, difference=res.delta or ref is None or ref.shape != value.shape)
    except InvalidUpdateError:  # NaN: finite tensors were checked at acceptance, so never in practice
        return math.inf
    return meter.value


def load_quotas(path: str | os.PathLike[str]) -> dict[str, int]:
    """The quotas of a TOML file of ``"identity" = examples`` lines.

    Raises:
        ConfigError: (key ``client_quotas``) the file cannot be read or parsed, or a value is
            not an integer at least 1.
    """
    try:
        with open(path, "rb") as f:
            table: dict[str, Any] = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(
            "client_quotas", f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("client_quotas", f"{os.fspath(path)!r} is not TOML: {exc}") from None
    for name, quota in table.items():
        if isinstance(quota, bool) or not isinstance(quota, int) or quota < 1:
            raise ConfigError(
                "client_quotas",
                f"{os.fspath(path)!r}: the quota of {escape(name)} must be an integer at least 1 "
                f'(lines of "identity" = examples), got {quota!r}',
            )
    return dict(table)


def build_influence(config: "Config") -> Influence:
    """The influence caps of a run's configuration (``max_weight_ratio``, ``client_quotas``,
    ``max_update_ratio``, ``max_weight_share``, ``min_update_cosine``, ``max_deviation_ratio``).

    Raises:
        ConfigError: an unreadable or malformed quota file.
    """
    quotas = load_quotas(config.client_quotas) if config.client_quotas else {}
    return Influence(
        max_weight_ratio=config.max_weight_ratio,
        client_quotas=quotas,
        max_update_ratio=config.max_update_ratio,
        max_weight_share=config.max_weight_share,
        min_update_cosine=config.min_update_cosine,
        max_deviation_ratio=config.max_deviation_ratio,
    )
