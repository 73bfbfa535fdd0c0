"""Client-level differential privacy of a run's fit rounds (DP-FedAvg with central noise;
docs/privacy.rst): the round engine's privacy stage.

It runs where a fit round closes (``RoundEngine._fit``), after the influence bounds
(``server/influence.py``) and before the strategy aggregates, so every fleet (a deployment's,
a simulation's, a replay) applies it to the same results with the same bits:

1. **Budget.** Before the round's tasks go out, the accountant (``aggregation/accounting.py``)
   computes the epsilon the run would reach if the round sampled the share of the live clients
   it selected; over ``dp_epsilon`` the run stops there (``PrivacyBudgetError``), the round
   never run. The share that reports is at most the share selected, and epsilon grows with it.
2. **Clipping.** Each result's update (its difference from the model its task sent, over the
   floating tensors) is scaled to L2 norm at most the clip; its weight in the mean becomes 1
   (a client's influence is bounded by the clip alone, whatever it claims).
3. **Noise.** Gaussian noise of std ``sigma * clip`` (``noise_share``, a secure stream keyed by
   the run's noise key) is added to the sum of the clipped updates: each of the ``n`` results
   carries ``1/n`` of it, so the strategy's mean is ``(sum + noise) / n`` whatever it does next
   (a server optimizer, momentum).
4. **Accounting.** The round is spent at its real sampling rate: the results aggregated over
   the clients live. ``epsilon`` goes to the round's metrics (``metrics.jsonl``).
5. **Adaptive clip** (``dp_clip = "adaptive"``): the next round's clip moves geometrically
   towards the median update norm, from the noised count of unclipped updates (Andrew et al.).

Under SecAgg+ (``distributed``) the server sees one masked sum: the clients clip and add the
noise themselves (``client.secagg.DistributedNoise``), so steps 2 and 3 are theirs, step 5 is the
strategy's (``aggregation.secagg.SecAgg``: the clients sum their unclipped bits securely, as one
more masked coordinate with its own noise), and this stage only checks and charges the budget (1
and 4), on the round's masked uploads.

The noise key, the clip and the accountant's rounds are the stage's state, checkpointed with
the round (``server/state.py``): a resumed coordinator redraws the noise of the round it redoes
bit for bit and keeps the budget spent. The key is the ``dp_noise_key`` file's when one is
given (a simulation given a deployment's file draws its noise bit for bit); else a deployment's
is 32 bytes of ``os.urandom`` and a simulation's is derived from its seed (``simulation_key``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from fedgrid.aggregation.accounting import Accountant
from fedgrid.aggregation.privacy import (
    KEY_BYTES,
    clip_update,
    next_clip,
    noise_share,
    secure_normal,
    split_noise,
)
from fedgrid.aggregation.updates import client_delta
from fedgrid.config_privacy import parse_dp_clip, read_noise_key
from fedgrid.errors import ConfigError, PrivacyBudgetError
from fedgrid.types import FitRes, ModelState

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["Privacy", "build_privacy", "restore_privacy", "simulation_key", "EPSILON"]

log = logging.getLogger(__name__)

#: ``RoundMetrics.extra`` keys of a DP round: the epsilon spent so far (at ``dp_delta``), the clip
#: the round's updates were clipped to, and (adaptive) the noised share of unclipped updates.
EPSILON = "epsilon"
DP_CLIP = "dp_clip"
DP_UNCLIPPED = "dp_unclipped"


def simulation_key(seed: int) -> bytes:
    """A simulation's noise key: derived from its ``seed``, so a simulation is reproducible
    (and its noise is not secret: its privacy is a measurement, not a guarantee)."""
    return hmac.new(b"fedgrid-dp-simulation-key", str(seed).encode(), hashlib.sha256).digest()


class Privacy:
    """The DP stage of a run's fit rounds (module docstring).

    Args:
        noise_multiplier: sigma; the noise on the clipped updates' sum has std ``sigma * clip``.
        clip: the L2 norm updates are clipped to (adaptive: the first round's).
        adaptive: the clip follows the median update norm (Andrew et al.).
        epsilon: the budget; 0: none (epsilon is still recorded).
        delta: the delta of the epsilons.
        accountant: ``rdp`` or ``pld``.
        key: the noise key (at least 32 bytes); ``None``: 32 bytes of ``os.urandom``.
        distributed: the clients clip and add the noise under SecAgg+; the stage only accounts
            (adaptive: the clip is the SecAgg strategy's, from a count the clients sum securely).

    Raises:
        ValueError: a value out of range.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip: float,
        adaptive: bool = False,
        epsilon: float = 0.0,
        delta: float = 1e-5,
        accountant: str = "rdp",
        key: bytes | None = None,
        distributed: bool = False,
    ) -> None:
        self.distributed = distributed
        if not noise_multiplier > 0 or not clip > 0 or epsilon < 0:
            raise ValueError(
                f"needs noise_multiplier > 0, clip > 0, epsilon >= 0; got {noise_multiplier}, {clip}, {epsilon}"
            )
        self.noise_multiplier = noise_multiplier
        self.clip = clip
        self.adaptive = adaptive
        self.budget = epsilon
        self.accountant = Accountant(accountant, delta)
        self.key = key if key is not None else os.urandom(KEY_BYTES)
        if len(self.key) < KEY_BYTES:
            raise ValueError(f"a noise key needs at least {KEY_BYTES} bytes, got {len(self.key)}")

    def check_budget(self, server_round: int, *, selected: int, live: int) -> None:
        """Stops the run before ``server_round`` when sampling ``selected`` of ``live`` clients would
        spend more than the budget.

        Raises:
            PrivacyBudgetError: one line naming the round, the epsilons and delta.
        """
        if not self.budget or selected == 0:
            return
        after = self.accountant.epsilon_after(min(1.0, selected / max(live, 1)), self.noise_multiplier)
        if after > self.budget:
            raise PrivacyBudgetError(
                f"privacy budget reached: round {server_round} would spend epsilon {after:.4g} > dp_epsilon "
                f"{self.budget:g} at delta {self.accountant.delta:g} (spent: epsilon "
                f"{self.accountant.epsilon():.4g} in {self.accountant.rounds} rounds); the run stops after "
                f"round {server_round - 1}"
            )

    def apply(
        self, server_round: int, results: Sequence[FitRes], base: Mapping[str, torch.Tensor], *, live: int
    ) -> tuple[list[FitRes], dict[str, float]]:
        """The round's results clipped and noised (as differences, weight 1 each), and the round's
        DP metrics; the round is spent at rate ``len(results) / live``.

        Raises:
            ValueError: results that do not hold every floating tensor of ``base`` in its shape.
        """
        n = len(results)
        if n == 0:
            return [], {EPSILON: self.accountant.epsilon(), DP_CLIP: self.clip}
        if self.distributed:  # masked inputs, already clipped and noised by their clients
            rate = min(1.0, n / max(live, 1))
            spent = {EPSILON: self.accountant.spend(rate, self.noise_multiplier)}
            # An adaptive clip is the strategy's (``SecAgg``), which reports it with the unmasked sum.
            return list(results), spent if self.adaptive else {**spent, DP_CLIP: self.clip}
        names = [name for name, t in base.items() if t.dtype.is_floating_point]
        sigma, sigma_count = (
            split_noise(self.noise_multiplier, n) if self.adaptive else (self.noise_multiplier, 0.0)
        )
        clipped: list[ModelState] = []
        unclipped = 0
        for res in results:
            update, norm = clip_update(client_delta(base, res, names), self.clip)
            clipped.append(update)
            unclipped += norm <= self.clip
        noise = noise_share(self.key, server_round, clipped[0], std=sigma * self.clip)
        out = [_noised(res, update, noise, n) for res, update in zip(results, clipped)]
        metrics = {EPSILON: self.accountant.spend(min(1.0, n / max(live, 1)), self.noise_multiplier)}
        metrics[DP_CLIP] = self.clip
        if self.adaptive:
            count_noise = secure_normal(self.key, server_round, "count") * sigma_count
            metrics[DP_UNCLIPPED] = (unclipped + count_noise) / n
            self.clip = next_clip(self.clip, unclipped, n, count_noise)
        return out, metrics

    def state_dict(self) -> dict[str, Any]:
        """The key, the clip and the accountant's rounds (the checkpoint's ``privacy``)."""
        return {"key": self.key, "clip": self.clip, "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's privacy state: the budget spent and the noise key stay the run's.

        Raises:
            ValueError: a short key or an accountant of another kind or delta.
        """
        key = bytes(state["key"])
        if len(key) < KEY_BYTES:
            raise ValueError(
                f"the checkpoint's noise key holds {len(key)} bytes, at least {KEY_BYTES} are needed"
            )
        self.accountant.load_state_dict(state["accountant"])
        self.key, self.clip = key, float(state["clip"])


def restore_privacy(privacy: Privacy | None, state: Mapping[str, Any], checkpoint: str) -> None:
    """A resume's DP state: ``state`` (a checkpoint's) into ``privacy``. A run's DP cannot be
    switched on or off across a restart: the budget would be reset, or dropped.

    Raises:
        ConfigError: (key ``dp_noise_multiplier``) a checkpoint written with DP on, DP off now, or the reverse.
    """
    if (privacy is None) != (not state):
        raise ConfigError(
            "dp_noise_multiplier",
            f"{checkpoint} was written with DP {'off' if privacy is not None else 'on'}: a run's DP is "
            "kept across a restart (start a new run with --fresh)",
        )
    if privacy is not None:
        privacy.load_state_dict(state)


def _noised(res: FitRes, update: ModelState, noise: ModelState, n: int) -> FitRes:
    """``res`` as its clipped difference plus ``1/n`` of the round's noise, of weight 1."""
    state: ModelState = OrderedDict(res.state)
    for name, value in update.items():
        state[name] = value + (noise[name].to(value.dtype) / n)
    return dataclasses.replace(res, state=state, delta=True, weight=1.0)


def build_privacy(config: "Config", *, simulation: bool = False) -> Privacy | None:
    """The DP stage of ``config`` (``None`` with DP off). Its noise key: the ``dp_noise_key``
    file's; else a simulation's is derived from ``seed`` (``simulation_key``) and a coordinator's
    is fresh and secret (a resume restores the run's own from the checkpoint).

    Raises:
        ConfigError: an unreadable or short ``dp_noise_key`` file.
    """
    if not config.dp_noise_multiplier:
        return None
    clip, adaptive = parse_dp_clip(config.dp_clip)
    key = None
    if config.dp_noise_key:
        key = read_noise_key(config.dp_noise_key)
    elif simulation:
        key = simulation_key(config.seed)
    return Privacy(
        noise_multiplier=config.dp_noise_multiplier,
        clip=clip,
        adaptive=adaptive,
        epsilon=config.dp_epsilon,
        delta=config.dp_delta,
        accountant=config.dp_accountant,
        key=key,
        distributed=config.secagg,
    )
