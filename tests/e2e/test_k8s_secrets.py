"""``secrets.sh``, what ``fedgrid launch --emit k8s`` writes for the Secrets, run for real.

No cluster runs here, so ``kubectl`` is a recorder on PATH; ``fedgrid certs`` is the real
command. The script makes the CA and every certificate the manifests name, each server's
naming the Service its peers dial, creates one Secret per site from files that exist, and a
second run issues nothing again (it only updates the Secrets). Then the coordinator and a region
run their manifests' own command lines with those certificates (paths mapped to this machine,
port 0 on loopback), and each pod's probes pass against them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.ops.k8s import CERTS_DIR, DATA_DIR, GRPC_PORT

import zygote
from harness import FEDGRID, child_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "docker" / "topology.toml"
BIN = Path(sys.executable).parent  # the environment's `fedgrid` script

KUBECTL = """#!{python}
import json, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _run_script(out: Path, pki: Path, tmp_path: Path) -> list[list[str]]:
    fake, log = tmp_path / "bin", tmp_path / "kubectl.jsonl"
    fake.mkdir(exist_ok=True)
    (fake / "kubectl").write_text(KUBECTL.format(python=sys.executable, log=str(log)))
    (fake / "kubectl").chmod(0o755)
    log.write_text("")
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}", "PKI": str(pki)}
    done = subprocess.run(
        ["/bin/sh", str(out / "secrets.sh")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def issued(tmp_path_factory) -> tuple[Path, Path, list[list[str]]]:
    """``fedgrid launch --emit k8s`` for docker/topology.toml, then its secrets.sh, run once:
    the manifests' folder, the CA's and the kubectl calls."""
    tmp_path = tmp_path_factory.mktemp("k8s")
    out, pki = tmp_path / "manifests", tmp_path / "pki"
    done = subprocess.run(
        [str(BIN / "fedgrid"), "launch", "--emit", "k8s", "--out", str(out), str(TOPOLOGY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"kubectl apply -f {out}" in done.stdout
    return out, pki, _run_script(out, pki, tmp_path)


def test_secrets_sh_issues_every_certificate_and_makes_one_secret_per_site(issued, tmp_path):
    out, pki, calls = issued

    # Each Secret: `create secret generic NAME --from-file=KEY=PATH ... --dry-run=client -o yaml`,
    # piped into `apply -f -`.
    creates = [c for c in calls if c[:3] == ["create", "secret", "generic"]]
    assert len(calls) == 2 * len(creates) and calls.count(["apply", "-f", "-"]) == len(creates)
    secrets = {}
    for c in creates:
        assert c[-3:] == ["--dry-run=client", "-o", "yaml"]
        files = dict(
            a.removeprefix("--from-file=").split("=", 1) for a in c[4:] if a.startswith("--from-file=")
        )
        assert all(Path(path) == pki / key and Path(path).is_file() for key, path in files.items()), files
        secrets[c[3]] = files

    # The Secrets are the ones the pods mount.
    mounted = {
        v["secret"]["secretName"]
        for p in out.glob("*.yaml")
        for o in yaml.safe_load_all(p.read_text())
        if o["kind"] in ("StatefulSet", "Deployment", "Job")
        for v in o["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert set(secrets) == mounted and len(mounted) == 9

    # Server certificates name the Service their peers dial; every one is signed by the CA.
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    for name, service in [
        ("global", "fedgrid-global"),
        ("region-a-lan", "fedgrid-region-a"),
        ("region-b-lan", "fedgrid-region-b"),
    ]:
        cert = x509.load_pem_x509_certificate((pki / f"{name}.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [service]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.SERVER_AUTH in usage
        cert.verify_directly_issued_by(ca)
    for name in ("region-a", "client-5", "probe"):
        cert = x509.load_pem_x509_certificate((pki / f"{name}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        cert.verify_directly_issued_by(ca)
    # No site gets the CA's key; a client's Secret holds its own key only.
    assert not any("ca.key" in files for files in secrets.values())
    assert set(secrets["fedgrid-client-3-certs"]) == {"ca.pem", "client-3.pem", "client-3.key"}

    # A second run issues nothing (the certificates stay byte for byte) and updates the Secrets.
    before = {p.name: p.read_bytes() for p in pki.glob("*.pem")}
    again = _run_script(out, pki, tmp_path)
    assert sorted(again) == sorted(calls)  # the two ends of each pipe start in either order
    assert {p.name: p.read_bytes() for p in pki.glob("*.pem")} == before


def _workload(out: Path, name: str) -> dict:
    (found,) = [
        o
        for p in out.glob("*.yaml")
        for o in yaml.safe_load_all(p.read_text())
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["name"] == name
    ]
    (container,) = found["spec"]["template"]["spec"]["containers"]
    return container


def _here(args: list[str], pki: Path, data: Path) -> list[str]:
    """A pod's command line on this machine: its Secret's files from the CA's directory, its
    volume a folder, its port 0 on loopback."""
    return [
        a.replace(CERTS_DIR + "/", f"{pki}/")
        .replace(DATA_DIR, str(data))
        .replace(f"0.0.0.0:{GRPC_PORT}", "127.0.0.1:0")
        for a in args
    ]


def _probe(command: list[str], address: str, pki: Path) -> subprocess.CompletedProcess:
    assert command[:3] == ["fedgrid", "health", f"127.0.0.1:{GRPC_PORT}"]
    argv = [*FEDGRID, "health", address, *_here(command[3:], pki, Path("/nonexistent"))]
    return zygote.run(argv, capture_output=True, text=True, env=child_env(), timeout=60)


def test_the_probes_pass_mutual_tls_against_the_pods_own_command_lines(issued, tmp_path):
    """The coordinator and a region, started with the command lines of their manifests and the
    certificates secrets.sh made, answer their pods' probes (SERVING, exit 0): the server
    certificate names the Service the probe names, and the probe's client certificate is one the
    server admits. A probe naming another server fails (exit 1)."""
    out, pki, _ = issued
    processes: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> str:
        data = tmp_path / name
        log = open(tmp_path / f"{name}.log", "w")
        processes.append(
            zygote.popen([*FEDGRID, *args], stdout=log, stderr=subprocess.STDOUT, env=child_env())
        )
        address = data / "run" / "address"
        wait_until(
            lambda: (
                address.exists() and address.read_text().strip() != "" or processes[-1].poll() is not None
            ),
            timeout=120,
            what=f"{name}'s address",
        )
        assert processes[-1].poll() is None, (tmp_path / f"{name}.log").read_text()
        return address.read_text().strip()

    try:
        coordinator = _workload(out, "fedgrid-global")
        address = start("global", _here(coordinator["args"], pki, tmp_path / "global"))
        region = _workload(out, "fedgrid-region-a")
        args = _here(region["args"], pki, tmp_path / "region-a")
        assert args[args.index("--upstream") + 1] == f"fedgrid-global:{GRPC_PORT}"
        # The Service's name resolves in the cluster only: dial the address, verify the name.
        args[args.index("--upstream") + 1] = address
        region_address = start("region-a", [*args, "--upstream-server-name", "fedgrid-global"])
        for container, at in [(coordinator, address), (region, region_address)]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                done = _probe(container[probe]["exec"]["command"], at, pki)
                assert done.returncode == 0 and f"{at}: SERVING (fedgrid.v1.Coordinator)" in done.stdout, (
                    done.stdout + done.stderr
                )
        wrong = coordinator["livenessProbe"]["exec"]["command"]
        wrong = [a.replace("fedgrid-global", "fedgrid-region-a") for a in wrong]
        done = _probe(wrong, address, pki)
        assert done.returncode == 1 and "not reachable" in done.stderr, done.stdout + done.stderr
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(timeout=60)
