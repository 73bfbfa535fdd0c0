"""The multi-site kit in ``docker/``: a certs step on the CA's host (certs.yaml), one compose file
per site role (global.yaml, region.yaml, client.yaml) with docker/.env's addresses, the build
context's ignore file and the app layer (app.Dockerfile).

No Docker engine is needed here (tests/sites/ runs the kit on one: ``make test-sites``):
Compose's own binary validates the files, the services' commands are compared with
docker/topology.toml (which ``fedgrid launch`` runs here, as processes), and the certificate
scripts run on this machine with the real ``fedgrid certs``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import dockerfile
from composefiles import DOCKER, ROOT, compose_config, compose_json, pairs
from cryptography import x509

from fedgrid.ops.health import _flags as health_flags
from fedgrid.ops.launch import Identity, client_argv, coordinator_argv, load_topology, region_argv
from fedgrid.runlog import read_metrics

from harness import child_env

#: docker/.env's values (what the site files read when a site sets nothing else).
ENV = dict(
    line.split("=", 1)
    for line in (DOCKER / ".env").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
#: The flags `fedgrid launch` sets itself (addresses, directories, certificates, upstreams).
MANAGED = {
    *("--listen", "--out", "--state-dir", "--ca", "--cert", "--key", "--crl", "--coordinator"),
    *("--upstream", "--upstream-ca", "--upstream-cert", "--upstream-key"),
}
SITES = {"global", "region-a", "region-b", *(f"client-{i}" for i in range(6))}


def _unmanaged(argv: list[str]) -> dict[str, str]:
    return {k: v for k, v in pairs(argv).items() if k not in MANAGED}


def _certs_named(service: dict) -> set[str]:
    words = [*service.get("command", []), *service.get("healthcheck", {}).get("test", [])]
    return {w.removeprefix("/certs/") for w in words if isinstance(w, str) and w.startswith("/certs/")}


def test_every_compose_file_validates_and_a_missing_address_is_named(tmp_path):
    files = sorted(p.name for p in DOCKER.glob("*.yaml"))
    assert files == ["certs.yaml", "client.yaml", "common.yaml", "compose.yaml", "global.yaml", "region.yaml"]
    for name in files:
        done = compose_config(DOCKER / name)
        assert done.returncode == 0, (name, done.stderr)
    empty = tmp_path / "empty.env"
    empty.write_text("")
    for name, variable in (
        ("region.yaml", "REGION"),
        ("client.yaml", "CLIENT"),
        ("certs.yaml", "GLOBAL_HOST"),
    ):
        done = compose_config(DOCKER / name, env_file=empty)
        # Compose checks the file's variables in no fixed order: it names one of those it needs.
        needed = {
            "region.yaml": ("REGION", "REGION_HOST", "REGION_PORT", "GLOBAL_HOST", "GLOBAL_PORT"),
            "client.yaml": ("CLIENT", "PARTITION", "REGION_HOST", "REGION_PORT"),
            "certs.yaml": ("GLOBAL_HOST", "CERT_REGIONS", "CERT_CLIENTS"),
        }[name]
        assert variable in needed and done.returncode != 0, done.stderr
        assert any(f"set {v} in docker/.env" in done.stderr for v in needed), done.stderr


def test_each_site_publishes_its_port_and_holds_only_its_own_certificates():
    roles = {
        "global": ("coordinator", "GLOBAL_PORT", "GLOBAL_HOST", "probe"),
        "region": ("region", "REGION_PORT", "REGION_HOST", ENV["REGION"]),
        "client": ("client", None, None, None),
    }
    for role, (name, port, host, probe) in roles.items():
        services = compose_json(DOCKER / f"{role}.yaml", **({port: "6123"} if port else {}))["services"]
        assert set(services) == {"site-certs", name}
        service, loader = services[name], services["site-certs"]
        if port:
            assert [(p["target"], p["published"]) for p in service["ports"]] == [(50051, "6123")]
            assert pairs(service["command"])["--listen"] == "0.0.0.0:50051"
            test = service["healthcheck"]["test"]
            assert test[:3] == ["CMD", "fedgrid", "health"]
            check = health_flags(argparse.ArgumentParser()).parse_args(test[3:])
            assert (check.address, check.server_name, check.cert) == (
                "127.0.0.1:50051",
                ENV[host],  # the name its certificate holds (certs.yaml issues it so)
                f"/certs/{probe}.pem",
            )
        else:
            assert "ports" not in service and "healthcheck" not in service  # a client serves nothing
        mounts = {v["source"]: v for v in service["volumes"]}
        assert set(mounts) == {"certs", "data"} and mounts["certs"]["read_only"] is True
        assert mounts["data"]["target"] == "/var/lib/fedgrid"
        assert service["depends_on"]["site-certs"]["condition"] == "service_completed_successfully"
        # The loader checks for exactly the files the service names: its site's, never the CA's key.
        needs = set(loader["environment"]["NEEDS"].split())
        assert needs == _certs_named(service) and "ca.key" not in needs and "ca.pem" in needs
        assert [(v["source"], v["target"], v.get("read_only", False)) for v in loader["volumes"]] == [
            ("certs", "/certs", False)
        ]
        assert loader["network_mode"] == "none" and loader["user"] == "root"
    # The CA's volume is the certs step's alone.
    certs = compose_json(DOCKER / "certs.yaml")["services"]["certs"]
    assert [(v["source"], v["target"]) for v in certs["volumes"]] == [("ca", "/ca")]
    assert certs["network_mode"] == "none"


def test_the_sites_run_the_topology_fedgrid_launch_runs():
    """Every key docker/topology.toml gives a tier is the same flag and value in that role's file,
    for each region and client docker/.env can name."""
    top = load_topology(DOCKER / "topology.toml")
    x = Identity("ca", "cert", "key")
    coordinator = compose_json(DOCKER / "global.yaml")["services"]["coordinator"]["command"]
    assert _unmanaged(coordinator) == _unmanaged(
        coordinator_argv(top, listen="", out="", state_dir="", tls=x)
    )
    for region in top.regions:
        host = f"{region.name}.sites.example"
        command = compose_json(DOCKER / "region.yaml", REGION=region.name, REGION_HOST=host)["services"][
            "region"
        ]["command"]
        argv = region_argv(top, region, upstream="", listen="", out="", state_dir="", tls=x, upstream_tls=x)
        assert _unmanaged(command) == _unmanaged(argv)
        flags = pairs(command)
        assert flags["--upstream"] == f"{ENV['GLOBAL_HOST']}:{ENV['GLOBAL_PORT']}"
        assert (flags["--cert"], flags["--upstream-cert"]) == (
            f"/certs/{region.name}-lan.pem",
            f"/certs/{region.name}.pem",
        )
        for p in region.partitions:
            site = dict(CLIENT=f"client-{p}", PARTITION=f"{p}/{top.num_partitions}", REGION_HOST=host)
            command = compose_json(DOCKER / "client.yaml", **site)["services"]["client"]["command"]
            assert _unmanaged(command) == _unmanaged(client_argv(top, p, coordinator="", state_dir="", tls=x))
            assert pairs(command)["--coordinator"] == f"{host}:{ENV['REGION_PORT']}"
            assert pairs(command)["--cert"] == f"/certs/client-{p}.pem"


def _script(service: dict, folder: str, to: Path) -> list[str]:
    """The service's ``/bin/sh -ec SCRIPT NAME`` entrypoint, with FOLDER (a volume) moved to ``to``."""
    entry = service["entrypoint"]
    assert entry[:2] == ["/bin/sh", "-ec"] and len(entry) == 4
    # `config` prints $ as $$ (its output is a compose file again); the container's shell gets $.
    script = re.sub(rf"(?<![\w/]){folder}\b", str(to), entry[2].replace("$$", "$"))
    return ["/bin/sh", "-ec", script, entry[3]]


def test_the_certs_step_bundles_each_site_and_keeps_the_ca_key(tmp_path):
    certs = compose_json(DOCKER / "certs.yaml")["services"]["certs"]
    ca = tmp_path / "ca"
    ca.mkdir()
    run = _script(certs, "/ca", ca)
    # The real `fedgrid certs` (it imports no torch: 14 calls take seconds).
    env = {
        **os.environ,
        **certs["environment"],
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run([*run, *certs["command"]], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    sites = ca / "sites"
    assert {p.name for p in sites.iterdir()} == SITES
    everything = {p.name for p in ca.iterdir() if p.is_file()}
    for site in sites.iterdir():
        files = {p.name for p in site.iterdir()}
        keys = {f for f in files if f.endswith(".key")}
        assert "ca.pem" in files and "ca.key" not in files and files <= everything
        own = {"global": {"global.key", "probe.key"}}.get(site.name) or (
            {f"{site.name}-lan.key", f"{site.name}.key"}
            if site.name.startswith("region")
            else {f"{site.name}.key"}
        )
        assert keys == own, site.name
    for name, host in (("global", ENV["GLOBAL_HOST"]), ("region-b-lan", "region-b.fedgrid.example")):
        cert = x509.load_pem_x509_certificate((ca / f"{name}.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [host]

    before = {p: p.read_bytes() for p in ca.rglob("*") if p.is_file()}
    again = subprocess.run([*run, *certs["command"]], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and {p: p.read_bytes() for p in ca.rglob("*") if p.is_file()} == before

    bundle = subprocess.run([*run, "bundle", "region-a"], capture_output=True, env=env, timeout=60)
    assert bundle.returncode == 0, bundle.stderr
    with tarfile.open(fileobj=io.BytesIO(bundle.stdout)) as tar:
        names = {Path(m.name).name for m in tar.getmembers() if m.isfile()}
    assert names == {
        "ca.pem",
        "crl.pem",
        "region-a-lan.pem",
        "region-a-lan.key",
        "region-a.pem",
        "region-a.key",
    }
    wrong = subprocess.run([*run, "bundle", "region-c"], capture_output=True, text=True, env=env, timeout=60)
    assert wrong.returncode == 2 and "no site 'region-c' (sites: client-0" in wrong.stderr

    # The region's site loads that tar into its certs volume, for the image's user.
    loader = compose_json(DOCKER / "region.yaml")["services"]["site-certs"]
    volume, bin_dir = tmp_path / "site-certs", tmp_path / "bin"
    volume.mkdir()
    bin_dir.mkdir()
    (bin_dir / "chown").write_text(
        f'#!/bin/sh\necho "$@" >> {tmp_path / "chown.log"}\n'
    )  # no fedgrid user here
    (bin_dir / "chown").chmod(0o755)
    site_env = {**os.environ, **loader["environment"], "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    load = _script(loader, "/certs", volume)
    empty = subprocess.run(
        [*load, *loader["command"]], capture_output=True, text=True, env=site_env, timeout=60
    )
    assert empty.returncode == 1 and "run --rm -T site-certs load < region-a.tar" in empty.stderr
    loaded = subprocess.run(
        [*load, "load"], input=bundle.stdout, capture_output=True, env=site_env, timeout=60
    )
    assert loaded.returncode == 0, loaded.stderr
    assert {p.name for p in volume.iterdir()} == names
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in volume.glob("*.key"))
    assert (tmp_path / "chown.log").read_text() == f"-R fedgrid:fedgrid {volume}\n"
    ok = subprocess.run([*load, *loader["command"]], capture_output=True, text=True, env=site_env, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("site-certs: region-a's certificates: ca.pem")


def _ignored(patterns: list[str], path: str) -> bool:
    """``path`` left out of the build context by .dockerignore ``patterns`` (Go's filepath.Match
    with ``**``, anchored at the context's root; a folder's pattern covers what it holds; ``!`` unused)."""

    def regex(pattern: str) -> str:
        out = re.escape(pattern.strip("/"))
        out = out.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        return out.replace(r"\?", "[^/]") + "(?:/.*)?"

    return any(re.fullmatch(regex(p), path) for p in patterns)


def test_the_build_context_leaves_out_the_venv_and_keeps_what_the_image_copies():
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")]
    for path in (
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        "runs/demo/metrics.jsonl",
        ".git/HEAD",
    ):
        assert _ignored(patterns, path), path
    for path in (
        "build/docs/index.html",
        "server/__pycache__/app.cpython-311.pyc",
        "docker/region-a.tar",
        "x/y.key",
    ):
        assert _ignored(patterns, path), path
    copied = {
        source
        for step in dockerfile.parse_file(str(DOCKER / "Dockerfile"))
        if step.cmd.upper() == "COPY"
        for source in step.value[:-1]
    }
    tracked = subprocess.run(
        ["git", "ls-files", *copied], cwd=ROOT, capture_output=True, text=True, check=True
    )
    files = tracked.stdout.split()
    assert len(files) > 100 and not [f for f in files if _ignored(patterns, f)]


def test_the_app_layer_puts_the_app_on_the_import_path(tmp_path):
    steps = dockerfile.parse_file(str(DOCKER / "app.Dockerfile"))
    keywords = [s.cmd.upper() for s in steps]
    assert keywords == ["ARG", "FROM", "ARG", "COPY", "ENV"]
    assert steps[0].value == ("FEDGRID_IMAGE=fedgrid:latest",) and steps[1].value == ("${FEDGRID_IMAGE}",)
    assert steps[3].flags == ("--chown=fedgrid:fedgrid",) and steps[3].value == (".", "/opt/app/${APP}")
    assert steps[4].value == ("PYTHONPATH", "/opt/app")

    # What the layer holds, here: `fedgrid new myapp`'s folder (the build context) at
    # OPT/app/myapp, and --app and --model found from another directory (the image's workdir).
    made = subprocess.run(
        [sys.executable, "-m", "fedgrid.cli", "new", "myapp"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    shutil.copytree(tmp_path / "myapp", tmp_path / "opt" / "app" / "myapp")
    shutil.rmtree(tmp_path / "myapp")
    (tmp_path / "workdir").mkdir()
    code = (
        "from fedgrid.plugins import load_object;"
        "print(load_object('myapp.app:client', key='app').__module__, load_object('myapp.app:model', key='model').__module__)"
    )
    found = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path / "workdir",
        capture_output=True,
        text=True,
        env={**child_env(), "PYTHONPATH": str(tmp_path / "opt" / "app")},
        timeout=120,
    )
    assert (found.returncode, found.stdout) == (0, "myapp.app myapp.app\n"), found.stderr


def test_fedgrid_launch_runs_the_kits_topology(tmp_path):
    """docker/topology.toml as local processes (9: two regions of three clients), one global round."""
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedgrid.cli",
            "launch",
            str(DOCKER / "topology.toml"),
            "--rounds",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )
    logs = {str(p.relative_to(out)): p.read_text()[-800:] for p in out.rglob("*.log")}
    assert done.returncode == 0, (done.stdout, done.stderr, logs)
    assert [(m["round"], m["clients_ok"], m["clients_failed"]) for m in read_metrics(out / "global")] == [
        (1, 2, 0)
    ]
    top = load_topology(DOCKER / "topology.toml")
    for region in top.regions:
        lan = read_metrics(out / region.name)
        assert [(m["round"], m["clients_ok"]) for m in lan] == [
            (r, 3) for r in range(1, region.keys["regional_rounds"] + 1)
        ]
        for p in region.partitions:
            log = (out / region.name / f"client-{p}.log").read_text()
            assert (
                f"client digits-{p:04d}/6: {region.keys['regional_rounds']} rounds trained; run finished"
                in log
            )
