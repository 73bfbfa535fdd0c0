"""``fedgrid coordinator --secagg`` with ``fedgrid client`` processes under mutual TLS: the
clients take part under their certificates' identities, and the run learns."""

from __future__ import annotations

import json
from pathlib import Path

from fedgrid.ops import pki

from harness import start_client, start_coordinator

NAMES = ("site-a", "site-b", "site-c")


def test_a_deployed_run_aggregates_securely_over_mutual_tls(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    pki.init_ca(certs)
    pki.issue(certs, "coordinator", server=True)
    for name in NAMES:
        pki.issue(certs, name)
    ca = str(certs / "ca.pem")
    out = tmp_path / "run"
    proc, address = start_coordinator(
        out, "--model", "linear_app:model", "--rounds", "1", "--min-clients", "3", "--local-epochs", "1",
        "--secagg", "--ca", ca, "--cert", str(certs / "coordinator.pem"), "--key", str(certs / "coordinator.key"),
    )  # fmt: skip
    clients = [
        start_client(
            address,
            tmp_path / f"{name}.log",
            "--app",
            "linear_app:client",
            "--partition",
            f"{i}/3",
            "--ca",
            ca,
            "--cert",
            str(certs / f"{name}.pem"),
            "--key",
            str(certs / f"{name}.key"),
            "--server-name",
            "localhost",
        )  # fmt: skip
        for i, name in enumerate(NAMES)
    ]
    try:
        assert proc.wait(timeout=120) == 0
        assert [c.wait(timeout=60) for c in clients] == [0, 0, 0]
    finally:
        for p in (proc, *clients):
            if p.poll() is None:
                p.kill()
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["secagg_survivors"], r["secagg_aborted"], r["secagg-unmask_ok"]) for r in rounds] == [
        (3.0, 0.0, 3)
    ]
    assert (out / "model.safetensors").exists()
    assert all("no secure aggregation" not in (tmp_path / f"{n}.log").read_text() for n in NAMES)
