"""Emulated WAN links: a userspace TCP relay that adds delay, a bandwidth limit, loss and
partitions between a client and a server (``fedgrid wan``, the tests, the multi-region
benchmark).

Why a relay: the kernel of these machines has no ``tc netem`` (DESIGN.md section 5), and
a relay needs neither root nor network namespaces, so a test can put a WAN in front of any
TCP server on port 0. A process reaches the target "across the WAN" by dialing the relay's
address instead of the target's; everything on top of TCP (gRPC, TLS end to end) passes
through unchanged.

The model, per direction ("up" is the accepting side to the target, "down" the way back):

- **Delay.** Every byte arrives ``delay_ms`` (plus a uniform draw in ``±jitter_ms``,
  never below zero, never reordering bytes) after it leaves the link, so the round-trip
  time through the relay is 2 × ``delay_ms`` plus the real one (loopback: tens of µs).
- **Bandwidth.** Each direction is one link of ``rate_mbit``, shared by all the relay's
  connections (a site's uplink, not a per-flow limit). Bytes leave it in pieces of about
  2 ms of link time (one MSS at least, 64 KiB at most) no faster than the rate, so the
  largest burst is one piece and a long transfer's throughput converges to the rate. A
  connection reserves link time at most 20 ms ahead, so connections sharing the link
  take turns instead of one queueing megabytes in front of the others.
- **Loss.** TCP is reliable: a lost packet shows up as a stall, not as missing bytes. The
  stream is cut into MSS-sized segments (1448 bytes) at fixed offsets, each lost with
  probability ``loss`` (seeded: one ``random.Random`` per connection and direction, so a
  seeded run loses the same segments however the reads fall). A lost segment arrives one
  retransmission timeout late, RTO = max(200 ms, 2 × the emulated RTT), and holds back
  everything behind it on its connection (in-order delivery), so each lost segment costs
  its connection one RTO: a transfer of S segments takes about S × ``loss`` × RTO longer.
  This is the retransmission-timeout case of every loss; real TCP recovers many single
  losses by fast retransmit in about one RTT but also shrinks its window, which this
  model leaves out. Other connections keep the link meanwhile.
- **Partitions.** ``partition("blackhole")``: connections stay open but nothing crosses
  (neither data nor a FIN), and new connections are accepted but stall, as a real
  partition looks to TCP and to gRPC keepalives; after ``heal()`` what was held is
  delivered. ``partition("reset")``: every connection is reset (RST both ways) and new
  ones are reset as soon as they are accepted (the listening port stays the relay's, so
  its address holds across partitions).
- **Buffers.** A connection holds at most its link's bandwidth-delay product plus 1 MiB
  per direction (64 MiB at most); past that it stops reading from the sender, whose
  kernel buffers fill and whose writes block (backpressure, as through a real path). An
  unlimited link is therefore window-limited to about 1 MiB per RTT.

It is an emulator, not a network service: no authentication and nothing of its own to
protect, it listens on loopback unless told otherwise, and it still bounds what a peer can
make it hold (``max_connections``, the per-connection buffers above). ``set_link`` changes
the link at run time: pieces already scheduled keep their times, later ones use the new
link. Public methods are called from threads other than the relay's own event loop.

Its parts: ``wan_link`` (the link model: pacing, delay, loss), ``wan_relay`` (the relay,
``WanRelay``); this module presents both and holds the command, ``fedgrid wan``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
from pathlib import Path

from fedgrid.errors import ConfigError
from fedgrid.interrupts import GracefulStop, say
from fedgrid.ops.wan_link import MAX_CONNECTIONS, MIN_RTO_S, MSS, LinkClock, WanLink
from fedgrid.ops.wan_relay import WanRelay, parse_hostport

__all__ = [
    "WanLink",
    "WanRelay",
    "LinkClock",
    "parse_hostport",
    "add_arguments",
    "command",
    "MSS",
    "MIN_RTO_S",
]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """The link's flags (``WanLink``'s fields)."""
    parser.add_argument(
        "--delay-ms",
        dest="delay_ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="one-way delay each way (default 0)",
    )
    parser.add_argument(
        "--jitter-ms",
        dest="jitter_ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="the delay varies within ± this (default 0)",
    )
    parser.add_argument(
        "--rate-mbit",
        dest="rate_mbit",
        type=float,
        default=None,
        metavar="MBIT",
        help="bandwidth each way in Mbit/s, shared by all connections (default: unlimited)",
    )
    parser.add_argument(
        "--loss",
        type=float,
        default=0.0,
        metavar="P",
        help="probability that a 1448-byte segment is lost and arrives one RTO late (default 0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss and jitter draws (default 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``fedgrid wan``'s flags."""
    parser.add_argument(
        "--target",
        required=True,
        metavar="HOST:PORT",
        help="where every connection is forwarded (e.g. the coordinator)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where to listen (default 127.0.0.1:0, a free port on loopback; another host must be given here)",
    )
    _add_link_arguments(parser)
    parser.add_argument(
        "--max-connections",
        dest="max_connections",
        type=int,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=f"connections open at once; more are reset (default {MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--address-file",
        dest="address_file",
        default="",
        metavar="FILE",
        help="write the relay's HOST:PORT here once it listens (atomically; its folder is made)",
    )


def command(args: argparse.Namespace) -> int:
    """``fedgrid wan``: relays until SIGTERM or Ctrl-C, then exits 0.

    Raises:
        ConfigError: a bad flag, an ``--address-file`` whose folder cannot be made (exit 2).
        OSError: the address cannot be bound (exit 1).
    """
    link = WanLink(
        delay_ms=args.delay_ms,
        rate_mbit=args.rate_mbit,
        loss=args.loss,
        jitter_ms=args.jitter_ms,
        seed=args.seed,
    )
    listen = parse_hostport(args.listen, key="listen")
    target = parse_hostport(args.target, key="target")
    address_file = Path(args.address_file) if args.address_file else None
    if address_file is not None:  # its folder made before anything listens or prints
        try:
            address_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                "address_file", f"cannot make the folder {str(address_file.parent)!r}: {exc.strerror or exc}"
            ) from None
    relay = WanRelay(target, link, listen, max_connections=args.max_connections).start()
    stop = threading.Event()

    def on_stop(signal_name: str) -> None:
        say(f"{signal_name}: stopping the relay; a second one exits at once")
        stop.set()

    try:
        if not _is_loopback(listen[0]):
            print(
                f"fedgrid wan: listening on {listen[0]}, not loopback: the relay is a network emulator with no "
                "authentication; anyone who reaches it reaches the target",
                file=sys.stderr,
                flush=True,
            )
        if address_file is not None:
            tmp = address_file.with_name(address_file.name + ".tmp")
            tmp.write_text(relay.address + "\n")
            os.replace(tmp, address_file)
        print(f"fedgrid wan relaying {relay.address} -> {args.target}: {link.describe()}", flush=True)
        with GracefulStop(on_stop, what="wan"):
            while not stop.wait(1.0):
                pass
    finally:
        relay.stop()
    print(
        f"fedgrid wan stopped: {relay.connections_total} connections, {relay.bytes_up} bytes up, "
        f"{relay.bytes_down} bytes down, {relay.segments_lost} segments lost",
        flush=True,
    )
    return 0
