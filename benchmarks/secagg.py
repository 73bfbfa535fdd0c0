"""SecAgg+ cost: bandwidth expansion and client and server time, by dropout rate and ring.

For n clients (default 100) and a model of ``--params`` float32 parameters (default 1M), one
SecAgg+ round is run through the protocol's own classes (``SecAggParty`` for each client,
``SecAggServerRound`` for the coordinator; the relay is in memory) at each dropout rate
(default 0%, 10%, 30%; that share of the clients drops after sharing its keys and before
sending its masked input, the case that costs the coordinator most: it rebuilds their mask
keys and strips their pairwise masks from each surviving neighbour's input) and each ring:

- ``plain``: a 32-bit ring, against the plain float32 upload (codec ``none``, 4 bytes a parameter);
- ``int8``: an 8-bit ring, against the plain ``int8`` codec's upload (1 byte a parameter and its header);
- ``qsgd``: QSGD's 127 levels (over the public range, ``secagg_math.ring_scale(levels=127)``) in
  the 8-bit ring of its codes, against the plain ``qsgd:127`` upload (1 byte a parameter and a
  norm per 512-parameter bucket).

Per row: ``expansion``, a surviving client's bytes up (its masked input plus its advert,
share envelopes and unmask answer) over the plain upload of the same codec; ``msg KB``, those
message bytes; ``client s``, a client's compute for the round (median over clients: keys,
adverts checked, shares sealed and opened, quantization, masking, unmask answer);
``server s``, the coordinator's unmask (sum, secrets rebuilt, masks stripped). The unmasked sum
is checked to equal the survivors' quantized inputs, outside the timed window.

The threshold is a majority of the neighbourhood (k / 2 + 1, what the clients insist on), and
k is the smallest that keeps the round's chance of aborting under 1% at that dropout rate
(``secagg_math.neighbours_for``): about 2 log2 n is enough at 10%, 30% needs most of the
clients as neighbours. ``k`` and ``t`` are in the table.

    python benchmarks/secagg.py
    python benchmarks/secagg.py --clients 50 --params 100000 --out /tmp/secagg.json
    python benchmarks/secagg.py --rings qsgd --out /tmp/secagg-qsgd.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedgrid.aggregation.secagg_crypto import PinnedKeys
from fedgrid.aggregation.secagg_math import neighbours_for, quantize, ring_add, ring_scale
from fedgrid.aggregation.secagg_server import SecAggServerRound
from fedgrid.client.secagg_party import SecAggParty
from fedgrid.compression import get_codec
from fedgrid.types import TO_SERVER

__all__ = ["main", "run_round"]

#: Ring name: its bits, the plain codec it is measured against, and its QSGD levels (0: the whole ring).
RINGS = {"plain": (32, "none", 0), "int8": (8, "int8", 0), "qsgd": (8, "qsgd:127", 127)}


def _relay(sent: dict[str, dict[str, bytes]]) -> dict[str, dict[str, bytes]]:
    inbox: dict[str, dict[str, bytes]] = {}
    for sender, messages in sent.items():
        for to, payload in messages.items():
            if to != TO_SERVER:
                inbox.setdefault(to, {})[sender] = payload
    return inbox


def _timed(clock: dict[str, float], cid: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    clock[cid] = clock.get(cid, 0.0) + time.perf_counter() - start
    return out


def run_round(n: int, params: int, ring: str, dropout: float, seed: int) -> dict[str, Any]:
    """One round; returns its row (see the module docstring)."""
    bits, codec, levels = RINGS[ring]
    ids = [f"c{i:04d}" for i in range(n)]
    signers = {cid: Ed25519PrivateKey.generate() for cid in ids}
    keyring = PinnedKeys({cid: s.public_key() for cid, s in signers.items()})
    parties = {cid: SecAggParty(client_name=cid, signer=signers[cid], keyring=keyring) for cid in ids}
    k = neighbours_for(n, dropout)
    srv = SecAggServerRound(
        run="bench", server_round=1, participants=tuple(ids), k=k, graph_seed=b"%d" % seed,
        threshold=k // 2 + 1, bits=bits,
    )  # fmt: skip
    clock: dict[str, float] = {}
    msg_bytes: dict[str, int] = {cid: 0 for cid in ids}
    adverts = {cid: _timed(clock, cid, parties[cid].advertise, srv.plan_for(cid)) for cid in ids}
    srv.record_adverts({cid: m[TO_SERVER] for cid, m in adverts.items()})
    inbox = _relay(adverts)
    shares = {}
    for cid in ids:
        _timed(clock, cid, parties[cid].receive_adverts, 1, inbox.get(cid, {}))
        shares[cid] = _timed(clock, cid, parties[cid].share, 1)
    for cid in ids:
        msg_bytes[cid] += sum(len(p) for p in adverts[cid].values()) + sum(
            len(p) for p in shares[cid].values()
        )
    srv.record_shares(shares)
    inbox = _relay(shares)
    gone = set(random.Random(seed).sample(ids, round(dropout * n)))
    scale = ring_scale(bits=bits, clip=1.0, clients=n, levels=levels)
    gen = torch.Generator().manual_seed(seed)
    masked, inputs = {}, {}
    for cid in ids:
        if cid in gone:
            continue
        update = torch.randn(params, generator=gen) * 0.01
        _timed(clock, cid, parties[cid].receive_shares, 1, inbox.get(cid, {}))
        q, _ = _timed(
            clock, cid, quantize, update, weight=1 / n, clip=1.0, scale=scale, bits=bits, generator=gen
        )
        inputs[cid] = q
        masked[cid] = _timed(clock, cid, parties[cid].mask, 1, q, bits=bits)
    alive, dropped = srv.unmask_request(list(masked))
    answers = {}
    for cid in alive:
        answers[cid] = _timed(clock, cid, parties[cid].unmask, 1, survivors=alive, dropped=dropped)[TO_SERVER]
        msg_bytes[cid] += len(answers[cid])
    start = time.perf_counter()
    total = srv.unmask(masked, answers, survivors=alive)
    server_s = time.perf_counter() - start
    want = torch.zeros(params, dtype=torch.int64)
    for cid in alive:
        want = ring_add(want, inputs[cid], bits=bits)
    assert torch.equal(total, want), "the unmasked sum is not the survivors' sum"
    plain = len(get_codec(codec).encode(torch.randn(params, generator=gen)))
    masked_bytes = params * bits // 8
    per_client_msgs = statistics.median(msg_bytes[cid] for cid in alive)
    return {
        "ring": ring,
        "dropout": dropout,
        "clients": n,
        "params": params,
        "k": k,
        "threshold": srv.threshold,
        "survivors": len(alive),
        "plain_upload_bytes": plain,
        "masked_upload_bytes": masked_bytes,
        "message_bytes": per_client_msgs,
        "expansion": (masked_bytes + per_client_msgs) / plain,
        "client_s": statistics.median(clock[cid] for cid in alive),
        "server_s": server_s,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--dropouts", default="0,0.1,0.3")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rings", default=",".join(RINGS), help=f"of {', '.join(RINGS)}")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "secagg.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dropout in [float(d) for d in args.dropouts.split(",")]:
        for ring in args.rings.split(","):  # the rings alternate, so background load hits both alike
            rows.append(run_round(args.clients, args.params, ring, dropout, args.seed))
    print(f"SecAgg+ round: {args.clients} clients, {args.params:,} parameters")
    print(
        f"{'ring':>6} {'dropout':>8} {'k':>3} {'t':>3} {'survivors':>9} {'expansion':>9} {'msg KB':>8} {'client s':>9} {'server s':>9}"
    )
    for r in rows:
        print(
            f"{r['ring']:>6} {r['dropout']:>8.0%} {r['k']:>3} {r['threshold']:>3} {r['survivors']:>9} {r['expansion']:>9.4f} "
            f"{r['message_bytes'] / 1e3:>8.1f} {r['client_s']:>9.3f} {r['server_s']:>9.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
    out.write_text(json.dumps({"config": vars(args), "environment": env, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
