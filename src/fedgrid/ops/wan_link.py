"""The model of an emulated WAN link, without sockets: ``WanLink`` (delay, jitter, bandwidth,
loss, buffers) and ``LinkClock`` (when each piece of a stream arrives across it).

``fedgrid.ops.wan``'s relay runs bytes through this model; the model is described there.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fedgrid.errors import ConfigError

__all__ = ["WanLink", "LinkClock", "MSS", "MIN_RTO_S"]

#: Bytes of one TCP segment (Ethernet MTU 1500 minus IP, TCP and timestamp headers): the unit of loss.
MSS = 1448
#: Linux's minimum retransmission timeout.
MIN_RTO_S = 0.2
#: Link time per paced piece: small enough that a piece is no burst, large enough that a
#: 20 Mbit/s link moves ~500 pieces a second, not ten thousand.
PIECE_S = 0.002
MAX_PIECE_BYTES = 64 * 1024
READ_BYTES = 64 * 1024
#: How far ahead of the link's clock a connection may reserve link time.
HORIZON_S = 0.02
#: A connection's buffer past the bandwidth-delay product, and the cap of the whole.
BUFFER_SLACK_BYTES = 1 << 20
MAX_BUFFER_BYTES = 64 << 20
MAX_CONNECTIONS = 256


@dataclass(frozen=True)
class WanLink:
    """One emulated WAN link, the same both ways (see the module's docstring for the model).

    Args:
        delay_ms: one-way delay per direction; the RTT through the relay is twice this.
        rate_mbit: bandwidth per direction in Mbit/s (10^6 bit/s); ``None``: unlimited.
        loss: probability that a 1448-byte segment is lost (and arrives one RTO late).
        jitter_ms: the delay varies uniformly within ± this (bytes stay in order).
        seed: seeds the loss and jitter draws of each connection.

    Raises:
        ConfigError: a negative delay or jitter, a rate that is not positive, a loss outside [0, 1).
    """

    delay_ms: float = 0.0
    rate_mbit: float | None = None
    loss: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("delay_ms", "jitter_ms"):
            value = getattr(self, key)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(key, f"must be a finite number >= 0, not {value!r}")
        if self.rate_mbit is not None and not (math.isfinite(self.rate_mbit) and self.rate_mbit > 0):
            raise ConfigError(
                "rate_mbit", f"must be a number > 0 (or unset for no limit), not {self.rate_mbit!r}"
            )
        if not 0 <= self.loss < 1:
            raise ConfigError("loss", f"is a probability per segment, in [0, 1), not {self.loss!r}")

    @property
    def rtt_s(self) -> float:
        """The round-trip time the link adds (2 × delay)."""
        return 2 * self.delay_ms / 1000

    @property
    def rto_s(self) -> float:
        """The retransmission timeout a lost segment costs: max(200 ms, 2 × RTT)."""
        return max(MIN_RTO_S, 2 * self.rtt_s)

    @property
    def bytes_per_s(self) -> float:
        """The rate in bytes per second (infinite when unlimited)."""
        return math.inf if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

    @property
    def piece_bytes(self) -> int:
        """Bytes paced as one piece: about 2 ms of link time, within [MSS, 64 KiB]."""
        if self.rate_mbit is None:
            return MAX_PIECE_BYTES
        return max(MSS, min(MAX_PIECE_BYTES, int(self.bytes_per_s * PIECE_S)))

    @property
    def buffer_bytes(self) -> int:
        """What a connection holds per direction before it stops reading: BDP + 1 MiB, 64 MiB at most."""
        bdp = 0.0 if self.rate_mbit is None else self.bytes_per_s * self.rtt_s
        return int(min(MAX_BUFFER_BYTES, BUFFER_SLACK_BYTES + bdp))

    def describe(self) -> str:
        """The link in one line, as a log or a benchmark table names it."""
        rate = "unlimited" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        jitter = f" ±{self.jitter_ms:g} ms" if self.jitter_ms else ""
        return f"delay {self.delay_ms:g} ms{jitter} each way (RTT +{2 * self.delay_ms:g} ms), {rate}, loss {self.loss:g}"


class LinkClock:
    """The schedule of one connection in one direction: when each piece arrives. Pure (no
    I/O, the caller gives the time), so the model is tested without sockets.

    The direction's shared link clock is ``line``, a one-element list holding the time the
    link is next free, shared by every connection's ``LinkClock`` of that direction.

    Args:
        rng: this connection's and direction's draws (loss, jitter).
        line: the direction's shared ``[free_at]``.
    """

    def __init__(self, rng: random.Random, line: list[float]) -> None:
        self.rng = rng
        self.line = line
        #: Stream bytes scheduled so far (segment boundaries are multiples of MSS in it).
        self.offset = 0
        #: Segments lost so far.
        self.lost = 0
        self.last_arrival = 0.0
        #: After a loss, nothing of this connection leaves before this time.
        self.stalled_until = 0.0

    def ready_at(self) -> float:
        """The earliest time worth scheduling the next piece: the link (or this connection's
        stall) frees within ``HORIZON_S`` of it."""
        return max(self.line[0], self.stalled_until) - HORIZON_S

    def schedule(self, size: int, now: float, link: WanLink) -> float:
        """Reserves the link for the next ``size`` bytes of the stream and returns their arrival time.

        They leave when the link is free and this connection is not stalled, take
        ``size / rate`` on the link, and arrive ``delay`` (± jitter) later, plus one RTO per
        segment lost among those starting in them, never before the previous piece.
        """
        start = max(now, self.line[0], self.stalled_until)
        end = start + size / link.bytes_per_s
        self.line[0] = end
        lost = 0
        if link.loss > 0:
            first, last = -(-self.offset // MSS), (self.offset + size - 1) // MSS
            lost = sum(1 for _ in range(first, last + 1) if self.rng.random() < link.loss)
        self.offset += size
        delay = link.delay_ms / 1000
        if link.jitter_ms:
            delay = max(0.0, delay + self.rng.uniform(-link.jitter_ms, link.jitter_ms) / 1000)
        arrival = max(self.last_arrival, end + delay)
        if lost:
            self.lost += lost
            self.stalled_until = end + lost * link.rto_s
            arrival += lost * link.rto_s
        self.last_arrival = arrival
        return arrival
