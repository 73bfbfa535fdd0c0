"""The keys of differential privacy (DP-FedAvg, docs/privacy.rst), a group that
``fedgrid.config.Config`` inherits (``fedgrid.config_values.key``), and their checks.

DP is on when ``dp_noise_multiplier`` is above 0: every fit round's updates are clipped to
``dp_clip`` at the server and Gaussian noise of std ``dp_noise_multiplier * clip`` is added to
their sum (``fedgrid.server.privacy``), or with ``secagg`` by the clients, each its share
(``fedgrid.client.secagg.DistributedNoise``); an accountant (``dp_accountant``) tracks the
``(epsilon, dp_delta)`` spent, and with ``dp_epsilon`` the run stops before a round would
exceed it.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Protocol

from fedgrid.config_values import key as _key
from fedgrid.errors import ConfigError

__all__ = [
    "PrivacyKeys",
    "PrivateRun",
    "ACCOUNTANTS",
    "ADAPTIVE",
    "DEFAULT_ADAPTIVE_CLIP",
    "PRIVATE_STRATEGIES",
    "check_privacy",
    "parse_dp_clip",
    "read_noise_key",
    "NOISE_KEY_BYTES",
]

#: The shortest noise key (an AES-256 key's length).
NOISE_KEY_BYTES = 32
#: Values of ``dp_accountant`` (``fedgrid.aggregation.accounting``).
ACCOUNTANTS = ("rdp", "pld")
#: ``dp_clip``'s word for adaptive clipping (Andrew et al. 2021), optionally ``adaptive:INITIAL``.
ADAPTIVE = "adaptive"
#: The initial clip of ``dp_clip = "adaptive"`` (Andrew et al.'s 0.1; the quantile is tracked from there).
DEFAULT_ADAPTIVE_CLIP = 0.1
#: The strategies whose server step reads the round's mean update (so clipped, noised updates
#: are all it sees): the others keep per-client state or send more than the model.
PRIVATE_STRATEGIES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "diloco")


@dataclass(frozen=True)
class PrivacyKeys:
    """Differential privacy: client-level DP-FedAvg, the noise added at the server (or, with
    ``secagg``, by the clients, each its share)."""

    dp_noise_multiplier: float = _key(
        "differential privacy (docs/privacy.rst): sigma, the Gaussian noise on the sum of the round's clipped "
        "updates has std sigma * dp_clip; 0: DP off",
        0.0,
    )
    dp_clip: str = _key(
        "DP: the L2 norm each client's update is clipped to, a number, or adaptive[:INITIAL] (Andrew et al. "
        "2021: the clip follows the noised median of the update norms, from INITIAL, default 0.1)",
        "",
    )
    dp_epsilon: float = _key(
        "DP: the epsilon budget; the run stops before a round would spend more (0: no budget, epsilon "
        "is still recorded in metrics.jsonl)",
        0.0,
    )
    dp_delta: float = _key("DP: the delta of the (epsilon, delta) guarantee", 1e-5)
    dp_noise_key: str = _key(
        "DP: a file of at least 32 secret bytes keying the noise (head -c 32 /dev/urandom > FILE); "
        "empty: a coordinator draws a key (kept in its checkpoints), a simulation derives one from seed. "
        "A simulation given the deployment's file draws its noise bit for bit",
        "",
    )
    dp_accountant: str = _key(
        "DP: the accountant of dp-accounting (the privacy extra): rdp (Renyi DP) or pld (privacy loss "
        "distributions, tighter)",
        "rdp",
    )


class PrivateRun(Protocol):
    """What ``check_privacy`` reads of a run's configuration (a ``fedgrid.config.Config`` is one):
    the DP keys and the keys DP must agree with."""

    @property
    def dp_noise_multiplier(self) -> float: ...

    @property
    def dp_clip(self) -> str: ...

    @property
    def dp_epsilon(self) -> float: ...

    @property
    def dp_delta(self) -> float: ...

    @property
    def dp_noise_key(self) -> str: ...

    @property
    def dp_accountant(self) -> str: ...

    @property
    def strategy(self) -> str: ...

    @property
    def aggregator(self) -> str | None: ...

    @property
    def min_quorum(self) -> int: ...

    @property
    def hierarchy(self) -> bool: ...

    @property
    def secagg(self) -> bool: ...


def parse_dp_clip(text: str) -> tuple[float, bool]:
    """``dp_clip``'s text as ``(clip, adaptive)``: ``"1.5"`` is ``(1.5, False)``, ``"adaptive"``
    ``(DEFAULT_ADAPTIVE_CLIP, True)``, ``"adaptive:0.5"`` ``(0.5, True)``.

    Raises:
        ConfigError: (key ``dp_clip``) empty text, or a clip that is not a finite number above 0.
    """
    head, _, tail = text.strip().partition(":")
    adaptive = head == ADAPTIVE
    if not text.strip():
        raise ConfigError("dp_clip", "must be set with dp_noise_multiplier: a number above 0 or adaptive")
    if tail and not adaptive:
        raise ConfigError("dp_clip", f"expected a number or adaptive[:INITIAL], got {text!r}")
    number = (tail or str(DEFAULT_ADAPTIVE_CLIP)) if adaptive else head
    try:
        clip = float(number)
    except ValueError:
        raise ConfigError("dp_clip", f"expected a number or adaptive[:INITIAL], got {text!r}") from None
    if not (math.isfinite(clip) and clip > 0):
        raise ConfigError("dp_clip", f"must be a finite number above 0, got {text!r}")
    return clip, adaptive


def check_privacy(config: PrivateRun) -> None:
    """The DP keys' ranges and combinations (``fedgrid.config_checks.validate`` calls it).

    Raises:
        ConfigError: naming the first key out of range or set without DP on.
    """
    sigma = config.dp_noise_multiplier
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ConfigError("dp_noise_multiplier", f"must be a finite number at least 0, got {sigma}")
    if config.dp_accountant not in ACCOUNTANTS:
        raise ConfigError(
            "dp_accountant", f"unknown accountant {config.dp_accountant!r} (known: {', '.join(ACCOUNTANTS)})"
        )
    if not 0 < config.dp_delta < 1:
        raise ConfigError("dp_delta", f"must be in (0, 1), got {config.dp_delta}")
    if not (math.isfinite(config.dp_epsilon) and config.dp_epsilon >= 0):
        raise ConfigError(
            "dp_epsilon", f"must be a finite number at least 0 (0: no budget), got {config.dp_epsilon}"
        )
    if sigma == 0:
        for key in ("dp_clip", "dp_epsilon", "dp_noise_key"):
            if getattr(config, key):
                raise ConfigError(key, "needs dp_noise_multiplier above 0 (DP is off without noise)")
        return
    parse_dp_clip(config.dp_clip)
    _check_combinations(config)
    if config.dp_noise_key:
        read_noise_key(config.dp_noise_key)


def read_noise_key(path: str) -> bytes:
    """The noise key in file ``path`` (``dp_noise_key``): its bytes, at least ``NOISE_KEY_BYTES``.

    Raises:
        ConfigError: (key ``dp_noise_key``) an unreadable or short file.
    """
    try:
        with open(path, "rb") as f:
            key = f.read()
    except OSError as exc:
        raise ConfigError("dp_noise_key", f"cannot read {path!r}: {exc.strerror or exc}") from None
    if len(key) < NOISE_KEY_BYTES:
        raise ConfigError(
            "dp_noise_key",
            f"{path!r} holds {len(key)} bytes, at least {NOISE_KEY_BYTES} are needed "
            "(head -c 32 /dev/urandom > FILE)",
        )
    return key


def _check_distributed(config: PrivateRun) -> None:
    """DP under SecAgg+: no server noise key (each client keys its own noise); an adaptive clip's
    count is summed securely by the clients (``aggregation.secagg.SecAgg``)."""
    if config.dp_noise_key:
        raise ConfigError(
            "dp_noise_key",
            "with secagg each client keys its own share of the noise (a simulation's from seed): the "
            "coordinator holds no noise key (docs/privacy.rst)",
        )


def _check_combinations(config: PrivateRun) -> None:
    """DP's rounds: a known strategy over the plain mean, synchronous, not a simulated hierarchy."""
    if config.strategy not in PRIVATE_STRATEGIES:
        raise ConfigError(
            "dp_noise_multiplier",
            f"DP needs a strategy whose server step reads the mean update ({', '.join(PRIVATE_STRATEGIES)}), "
            f"got strategy {config.strategy!r}",
        )
    if config.aggregator not in (None, "mean"):
        raise ConfigError(
            "aggregator",
            f"DP adds its noise to the sum of the clipped updates: it needs the mean, got {config.aggregator!r}",
        )
    if config.min_quorum:
        raise ConfigError("min_quorum", "DP rounds are synchronous: a late result has no sampling rate")
    if config.hierarchy:
        raise ConfigError("hierarchy", "DP in a simulated hierarchy is not supported yet (docs/privacy.rst)")
    if config.secagg:  # the server sees one masked sum: the clients clip and add the noise
        _check_distributed(config)
    # find_spec, not an import: checking a config must not load the accountants.
    if importlib.util.find_spec("dp_accounting") is None:
        raise ConfigError("dp_accountant", "needs the dp-accounting package: pip install 'fedgrid[privacy]'")
