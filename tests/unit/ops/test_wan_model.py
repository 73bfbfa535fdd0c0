"""The WAN link model (``fedgrid.ops.wan``) without sockets: pacing, delay, the RTO cost of a
loss, seeded draws that do not depend on how reads fall, and a link shared by connections."""

from __future__ import annotations

import math
import random

import pytest

from fedgrid.errors import ConfigError
from fedgrid.ops.wan import MSS, LinkClock, WanLink, parse_hostport


def _send(clock: LinkClock, link: WanLink, total: int, step: int, now: float = 0.0) -> list[float]:
    """Schedules ``total`` bytes in pieces of ``step`` at time ``now`` (a sender far ahead of the link)."""
    return [clock.schedule(min(step, total - i), now, link) for i in range(0, total, step)]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"jitter_ms": math.nan}, "jitter_ms"),
        ({"rate_mbit": 0}, "rate_mbit"),
        ({"rate_mbit": math.inf}, "rate_mbit"),
        ({"loss": 1.0}, "loss"),
        ({"loss": -0.1}, "loss"),
    ],
)
def test_a_bad_link_is_refused_naming_its_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        WanLink(**kwargs)
    assert err.value.key == key


def test_derived_quantities():
    link = WanLink(delay_ms=25, rate_mbit=20)
    assert link.rtt_s == pytest.approx(0.05)
    assert link.rto_s == 0.2  # the 200 ms floor
    assert WanLink(delay_ms=150).rto_s == pytest.approx(0.6)  # 2 x RTT of 300 ms
    assert link.bytes_per_s == 2.5e6
    assert link.piece_bytes == 5000  # 2 ms at 20 Mbit/s
    assert WanLink(rate_mbit=1).piece_bytes == MSS and WanLink().piece_bytes == 64 * 1024
    assert link.buffer_bytes == (1 << 20) + 125_000  # BDP (2.5 MB/s x 50 ms) + 1 MiB
    assert WanLink(rate_mbit=10_000, delay_ms=500).buffer_bytes == 64 << 20
    assert link.describe() == "delay 25 ms each way (RTT +50 ms), 20 Mbit/s, loss 0"


def test_bytes_leave_at_the_rate_and_arrive_one_delay_later():
    link = WanLink(delay_ms=25, rate_mbit=20)
    clock = LinkClock(random.Random(0), [0.0])
    arrivals = _send(clock, link, 4_000_000, link.piece_bytes)
    assert arrivals[0] == pytest.approx(5000 / 2.5e6 + 0.025)  # one piece is the only burst
    assert arrivals[-1] == pytest.approx(4e6 / 2.5e6 + 0.025)
    assert arrivals == sorted(arrivals)
    # An idle link does not bank credit: a piece sent later leaves when it is sent.
    assert clock.schedule(5000, 10.0, link) == pytest.approx(10.0 + 0.002 + 0.025)


def test_an_unlimited_link_only_delays():
    link = WanLink(delay_ms=40)
    clock = LinkClock(random.Random(0), [0.0])
    assert _send(clock, link, 1_000_000, 65536, now=3.0) == [pytest.approx(3.04)] * 16


def test_each_lost_segment_costs_its_connection_one_rto():
    lossless, lossy = WanLink(rate_mbit=20, delay_ms=5), WanLink(rate_mbit=20, delay_ms=5, loss=0.05, seed=3)
    clean = _send(LinkClock(random.Random(0), [0.0]), lossless, 300_000, 5000)[-1]
    clock = LinkClock(random.Random("3/0/up"), [0.0])
    last = _send(clock, lossy, 300_000, 5000)[-1]
    assert math.ceil(300_000 / MSS) == 208
    assert 2 <= clock.lost <= 25  # 208 segments at 5 %: 10.4 expected
    assert last == pytest.approx(clean + clock.lost * lossy.rto_s)


def test_the_segments_lost_do_not_depend_on_how_the_reads_fall():
    link = WanLink(rate_mbit=50, loss=0.02)

    def run(steps: list[int]) -> tuple[int, float]:
        clock = LinkClock(random.Random("7/0/up"), [0.0])
        sent, i = 0, 0
        while sent < 1_000_000:
            size = min(steps[i % len(steps)], 1_000_000 - sent)
            clock.schedule(size, 0.0, link)
            sent, i = sent + size, i + 1
        return clock.lost, clock.last_arrival

    lost, last = run([5000])
    assert lost > 0
    for steps in ([1448], [3000, 17, 65536], [99_999], [1, 1447, 1449]):
        assert run(steps)[0] == lost, steps
    # A different seed loses different segments.
    other = LinkClock(random.Random("8/0/up"), [0.0])
    _send(other, link, 1_000_000, 5000)
    assert other.lost != lost or other.last_arrival != last


def test_the_loss_rate_is_the_probability_per_segment():
    link = WanLink(loss=0.01)
    clock = LinkClock(random.Random("0/0/up"), [0.0])
    _send(clock, link, 100_000 * MSS, 64 * MSS)
    # Binomial(100k, 0.01): mean 1000, sd 31.5; 5 sd either way.
    assert 840 < clock.lost < 1160


def test_connections_share_the_link_and_a_stalled_one_leaves_it_to_the_others():
    link = WanLink(rate_mbit=8)  # 1 MB/s
    line = [0.0]
    a, b = LinkClock(random.Random(1), line), LinkClock(random.Random(2), line)
    for _ in range(100):  # interleaved, as two senders taking turns
        a.schedule(5000, 0.0, link)
        b.schedule(5000, 0.0, link)
    assert a.last_arrival == pytest.approx(0.995) and b.last_arrival == pytest.approx(1.0)
    # a is stalled by a loss (say) until t = 5: b's pieces do not wait for it.
    a.stalled_until = 5.0
    assert b.schedule(5000, 1.0, link) == pytest.approx(1.005)
    assert a.schedule(5000, 1.0, link) == pytest.approx(5.005)


def test_jitter_varies_the_delay_but_never_reorders():
    link = WanLink(delay_ms=20, jitter_ms=10, rate_mbit=100)
    clock = LinkClock(random.Random(0), [0.0])
    arrivals = [clock.schedule(1000, t / 1000, link) for t in range(0, 2000, 2)]
    assert arrivals == sorted(arrivals)
    extra = [a - t / 1000 for a, t in zip(arrivals, range(0, 2000, 2))]
    assert min(extra) >= 0.010 and max(extra) <= 0.031
    assert max(extra) - min(extra) > 0.015  # it does vary


@pytest.mark.parametrize(
    "value, expected",
    [
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:8080", ("::1", 8080)),
        ("wan.example:50051", ("wan.example", 50051)),
    ],
)
def test_parse_hostport(value, expected):
    assert parse_hostport(value) == expected


@pytest.mark.parametrize("value", ["localhost", ":80", "host:", "host:99999", "host:x"])
def test_parse_hostport_refuses_a_bad_address_naming_the_flag(value):
    with pytest.raises(ConfigError, match=f"config key 'target': expected HOST:PORT, not '{value}'"):
        parse_hostport(value, key="target")
