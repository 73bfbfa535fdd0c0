"""A federation of docker/'s per-site compose files on one Docker engine, each site its own
compose project, volumes and .env, as separate hosts would run them (``tests/sites/``).

The certs step (certs.yaml) makes the CA and one bundle per site; each site loads its bundle
into its own certs volume (``site-certs load``) and starts its role's file (global.yaml,
region.yaml, client.yaml) unchanged. Sites reach each other as hosts do: at an address of this
host (docker0's) and the port the other site publishes there; the certificates name that address.
Waits are on conditions with deadlines; ``logs`` gives every site's containers' output for a
failure's report.
"""

from __future__ import annotations

import json
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from composefiles import DOCKER, compose_binary, compose_env
from docker_engine import docker

from harness import wait_until

#: Every project this module makes starts so (``leftovers`` finds a crashed run's).
PREFIX = "fgsites-"


def free_port() -> int:
    """A TCP port free on this host now (a site publishes it next)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


@dataclass
class Site:
    """One site: ROLE.yaml as compose project ``project``, with its own .env in ``folder``."""

    name: str
    role: str
    project: str
    folder: Path
    env: dict[str, str]

    def compose(
        self, *args: str, input: bytes | None = None, timeout: float = 180, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        argv = [str(compose_binary()), "-f", str(DOCKER / f"{self.role}.yaml"), "-p", self.project]
        done = subprocess.run(
            [*argv, "--env-file", str(self.folder / ".env"), *args],
            input=input,
            capture_output=True,
            env=compose_env(),
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{self.name}: docker compose {' '.join(args)} exited {done.returncode}: "
                f"{done.stderr.decode(errors='replace')[-3000:]}"
            )
        return done

    def container(self, service: str) -> str:
        """The id of the site's container of ``service`` (running or not)."""
        ids = self.compose("ps", "-a", "-q", service).stdout.decode().split()
        assert len(ids) == 1, (self.name, service, ids)
        return ids[0]

    def containers(self) -> list[str]:
        return self.compose("ps", "-a", "-q").stdout.decode().split()


def state(container: str) -> dict:
    """``docker inspect``'s State of a container, with its RestartCount."""
    info = json.loads(docker("inspect", container).stdout)[0]
    return {**info["State"], "RestartCount": info["RestartCount"]}


@dataclass
class Federation:
    """The sites of docker/topology.toml's federation (a global coordinator, two regions of three
    clients) under ``folder``, projects named ``fgsites-RUN-SITE``. The certs step also issues
    ``client-other``'s certificate: a site a test adds (``add``, ``load``, ``up``) beside them.
    ``topology``: (site, service) of the federation's running parts, in start order."""

    folder: Path
    image: str
    address: str
    run: str
    sites: dict[str, Site] = field(default_factory=dict)
    topology: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ports = {"global": free_port(), "region-a": free_port(), "region-b": free_port()}
        regions = {"region-a": (0, 1, 2), "region-b": (3, 4, 5)}
        clients = [f"client-{p}" for p in range(6)] + ["client-other"]
        self.add(
            "certs",
            "certs",
            GLOBAL_HOST=self.address,
            CERT_REGIONS=" ".join(f"{r}={self.address}" for r in regions),
            CERT_CLIENTS=" ".join(clients),
        )
        common = {"GLOBAL_HOST": self.address, "GLOBAL_PORT": str(self.ports["global"])}
        self.add("global", "global", **common)
        self.topology.append(("global", "coordinator"))
        for region in regions:
            self.add(region, "region", REGION=region, **common, **self.lan(region))
            self.topology.append((region, "region"))
        for region, partitions in regions.items():
            for p in partitions:
                self.add(
                    f"client-{p}", "client", CLIENT=f"client-{p}", PARTITION=f"{p}/6", **self.lan(region)
                )
                self.topology.append((f"client-{p}", "client"))

    def lan(self, region: str) -> dict[str, str]:
        """What a client site's .env says of its region: the host and the port it dials."""
        return {"REGION_HOST": self.address, "REGION_PORT": str(self.ports[region])}

    def add(self, name: str, role: str, **env: str) -> Site:
        """A site NAME of ROLE whose .env holds ``env`` (FEDGRID_IMAGE: the federation's image
        unless ``env`` names another), in a folder of its own."""
        folder = self.folder / name
        folder.mkdir(parents=True, exist_ok=True)
        values = {"FEDGRID_IMAGE": self.image, **env}
        (folder / ".env").write_text("".join(f'{k}="{v}"\n' for k, v in values.items()))
        site = Site(name, role, f"{PREFIX}{self.run}-{name}", folder, values)
        self.sites[name] = site
        return site

    def issue(self) -> None:
        """The certs step: the CA and every certificate, in the certs site's ca volume."""
        self.sites["certs"].compose("run", "--rm", "--pull", "never", "certs", timeout=300)

    def load(self, name: str) -> None:
        """The site's bundle (certs.yaml's ``bundle SITE``) loaded into the site's own certs
        volume, as an operator carries a tar from the CA's host to the site."""
        run = ("run", "--rm", "-T", "--pull", "never")
        bundle = self.sites["certs"].compose(*run, "certs", "bundle", name).stdout
        self.sites[name].compose(*run, "site-certs", "load", input=bundle)

    def up(self, name: str) -> None:
        self.sites[name].compose("up", "-d", "--no-build", "--pull", "never", timeout=300)

    def start(self, *, clients: bool = True, timeout: float = 300) -> None:
        """Certificates, then the coordinator, the regions and (``clients``, else
        ``start_clients`` later) the clients, each tier once the one it joins answers its
        health check. No round runs before every client of a region joined (``--min-clients 3``)."""
        self.issue()
        # Each load is two short containers (the bundle out of the CA's volume, into the site's):
        # side by side, not one after another; each site's project is its own.
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(self.load, [name for name, _ in self.topology]))
        self.up("global")
        self.wait_healthy("global", "coordinator", timeout=timeout)
        for region in ("region-a", "region-b"):
            self.up(region)
        for region in ("region-a", "region-b"):
            self.wait_healthy(region, "region", timeout=timeout)
        if clients:
            self.start_clients()

    def start_clients(self) -> None:
        for name, service in self.topology:
            if service == "client":
                self.up(name)

    def wait_until(
        self, condition: Callable[[], bool], *, timeout: float, what: str, interval: float = 1
    ) -> None:
        """``harness.wait_until``, failing with every site's logs as well."""
        try:
            wait_until(condition, timeout=timeout, what=what, interval=interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_healthy(self, name: str, service: str, *, timeout: float) -> None:
        container = self.sites[name].container(service)
        self.wait_until(
            lambda: state(container).get("Health", {}).get("Status") == "healthy",
            timeout=timeout,
            what=f"{name}'s {service} to be healthy",
        )

    def finished(self, name: str, service: str) -> bool:
        """Whether the service's container exited for good (its restart policy will not start it again)."""
        s = state(self.sites[name].container(service))
        return (
            s["Status"] == "exited" and not s["Restarting"] and (s["ExitCode"] == 0 or s["RestartCount"] >= 3)
        )

    def wait_finished(self, *, timeout: float) -> dict[str, dict]:
        """Every site's service exited; returns their states by site."""
        self.wait_until(
            lambda: all(self.finished(n, svc) for n, svc in self.topology),
            timeout=timeout,
            what="every site's run to end",
            interval=2,
        )
        return {n: state(self.sites[n].container(svc)) for n, svc in self.topology}

    def read(self, name: str, service: str, path: str, into: Path) -> Path:
        """A file of the service's container (running or exited), copied to ``into``."""
        docker("cp", f"{self.sites[name].container(service)}:{path}", str(into))
        return into

    def exec(self, name: str, service: str, *argv: str) -> str:
        return docker("exec", self.sites[name].container(service), *argv).stdout

    def logs(self, *, tail: int = 60) -> str:
        """Every site's containers' last ``tail`` lines."""
        out = []
        for site in self.sites.values():
            done = site.compose("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
            text = (done.stdout + done.stderr).decode(errors="replace").strip()
            if text:
                out.append(f"--- {site.project} ---\n{text}")
        return "\n".join(out)

    def down(self) -> None:
        """Every site's containers, networks and volumes removed (the images stay)."""
        for site in self.sites.values():
            site.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=180)


def remove_leftovers() -> list[str]:
    """Removes what a crashed run of this module left: containers, volumes and networks of
    projects named ``fgsites-*`` (never the images). Returns those projects."""
    projects: set[str] = set()
    for kind, remove in (
        ("container", ["rm", "-f", "-v"]),
        ("network", ["network", "rm"]),
        ("volume", ["volume", "rm"]),
    ):
        listing = ["ps", "-a"] if kind == "container" else [kind, "ls"]
        key = "ID" if kind == "container" else "Name"
        rows = docker(
            *listing, "--format", f'{{{{.{key}}}}} {{{{.Label "com.docker.compose.project"}}}}'
        ).stdout
        found = [line.split() for line in rows.splitlines() if len(line.split()) == 2]
        mine = [(name, project) for name, project in found if project.startswith(PREFIX)]
        if mine:
            docker(*remove, *(name for name, _ in mine), timeout=300)
        projects |= {project for _, project in mine}
    return sorted(projects)
