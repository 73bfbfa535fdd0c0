"""``fedgrid launch --emit k8s --out DIR TOPOLOGY.toml``: a topology as Kubernetes manifests.

The same federation that ``fedgrid launch`` runs as local processes and ``docker/`` runs as
compose sites, as objects for one Kubernetes namespace. Each site's command line is
``fedgrid.ops.topology``'s (the launcher's), with the paths of ``docker/``'s per-site kit:
certificates under ``/certs``, state and run directories under ``/var/lib/fedgrid``, gRPC on
port 50051.

What ``DIR`` gets (``kubectl apply -f DIR`` reads the ``.yaml`` files and skips the rest):

- ``coordinator.yaml``: the global coordinator, a StatefulSet of one whose PersistentVolumeClaim
  (``volumeClaimTemplates``) holds ``/var/lib/fedgrid`` (``--state-dir`` and ``--out``), so a
  rescheduled coordinator resumes its committed rounds; and its Service, ``fedgrid-global``.
- ``region-NAME.yaml``: each region's aggregator, a Deployment of one (``Recreate``: two pods of one
  region would join the coordinator under one identity), and its Service, ``fedgrid-NAME``.
- ``client-I.yaml``: each client, a Job. A client runs until the federation ends and then exits
  0: a Job completes there, where a Deployment would start it again; a client that fails is
  restarted in its pod (``restartPolicy: OnFailure``), where its ``--state-dir`` (an emptyDir,
  which lives as long as the pod) is still there to resume from.
- ``network-policy.yaml``: ingress to every fedgrid pod on the gRPC port only.
- ``secrets.sh``: the Secrets the pods mount, one per site, made from ``fedgrid certs`` output
  (the files of ``docker/certs.yaml``'s ``bundle SITE``). No private key is ever written here:
  the script reads them from the CA's directory when the operator runs it.

Every pod runs as the image's non-root user (uid 10001, ``docker/Dockerfile``) with a read-only
root filesystem (``/var/lib/fedgrid`` and ``/tmp`` are volumes), no privilege escalation and no
capabilities. Probes run ``fedgrid health`` in the container, as the compose kit's health checks
do: the health service sits behind mutual TLS on the gRPC port, which the kubelet's own
``grpc:`` probes (plaintext only) cannot pass.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fedgrid.errors import ConfigError
from fedgrid.ops.topology import (
    Identity,
    RegionSpec,
    Topology,
    TopologyError,
    client_argv,
    coordinator_argv,
    region_argv,
)

__all__ = [
    "GRPC_PORT",
    "DATA_DIR",
    "CERTS_DIR",
    "UID",
    "Site",
    "sites",
    "manifests",
    "secrets_script",
    "emit",
    "check_names",
]

#: The gRPC port of the coordinator and each region (docker/Dockerfile's EXPOSE).
GRPC_PORT = 50051
#: The image's writable home (docker/Dockerfile's WORKDIR): state/ and run/ go here.
DATA_DIR = "/var/lib/fedgrid"
#: Where a pod's Secret is mounted, read-only.
CERTS_DIR = "/certs"
#: docker/Dockerfile's non-root user and group.
UID = 10001
#: Every object's name starts with it: a namespace may hold other things.
PREFIX = "fedgrid"
#: The coordinator's PersistentVolumeClaim: its state (a checkpoint per round) and run directory.
STATE_STORAGE = "10Gi"
#: Kubernetes' DNS-1123 label: what a Service, a pod's hostname and a label value may be.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: A Service name is at most 63 characters: ``fedgrid-NAME``.
MAX_NAME = 63 - len(PREFIX) - 1
#: requests and limits: a torch process of the built-in tasks takes about 0.5 GiB; a client trains
#: on ``[clients] threads`` cores (``_client_resources``). Edit them (or patch them with kustomize)
#: for a larger model.
RESOURCES = {
    "coordinator": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
    "region": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
    "client": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
}
#: A client that fails is restarted in its pod this many times before its Job fails.
CLIENT_BACKOFF_LIMIT = 10
#: The compose kit's stop_grace_period: a coordinator's stop grace and a client's leave fit in it.
TERMINATION_GRACE_S = 30


@dataclass(frozen=True)
class Site:
    """One pod's site: its object name, its Secret and the files the Secret holds.

    Attributes:
        name: the site as ``docker/certs.yaml`` names it: ``global``, a region's name, ``client-I``.
        component: ``coordinator``, ``region`` or ``client``.
        files: the Secret's keys, each a file of ``fedgrid certs``' directory (the site's bundle).
        server_name: the name the site's server certificate holds (its Service); empty for a client.
    """

    name: str
    component: str
    files: tuple[str, ...]
    server_name: str = ""

    @property
    def object_name(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def secret(self) -> str:
        return f"{PREFIX}-{self.name}-certs"


def sites(top: Topology) -> list[Site]:
    """The topology's sites, coordinator first: what each pod is and which certificates it mounts."""
    out = [
        Site(
            "global",
            "coordinator",
            ("ca.pem", "crl.pem", "global.pem", "global.key", "probe.pem", "probe.key"),
            f"{PREFIX}-global",
        )
    ]
    for r in top.regions:
        files = (
            "ca.pem",
            "crl.pem",
            f"{r.name}-lan.pem",
            f"{r.name}-lan.key",
            f"{r.name}.pem",
            f"{r.name}.key",
        )
        out.append(Site(r.name, "region", files, f"{PREFIX}-{r.name}"))
    for r in top.regions:
        for p in r.partitions:
            out.append(Site(f"client-{p}", "client", ("ca.pem", f"client-{p}.pem", f"client-{p}.key")))
    return out


def check_names(top: Topology) -> None:
    """Each region's name must make valid object names (``fedgrid-NAME``: a DNS-1123 label).

    Raises:
        TopologyError: a region name with upper case, ``_`` or ``.``, or longer than fits (named).
    """
    for r in top.regions:
        if not DNS_LABEL.fullmatch(r.name) or len(r.name) > MAX_NAME:
            raise TopologyError(
                top.path,
                f"regions.{r.name}.name",
                f"names Kubernetes objects (fedgrid-{r.name}), so it must be a DNS-1123 label: lowercase "
                f"letters, digits and '-', starting and ending with a letter or digit, at most {MAX_NAME} "
                f"characters; got {r.name!r}",
            )


def _certs(*files: str) -> Identity:
    ca, cert, key = (f"{CERTS_DIR}/{f}" for f in ("ca.pem", *files))
    return Identity(ca, cert, key)


def _labels(site: Site, region: str = "") -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": PREFIX,
        "app.kubernetes.io/part-of": PREFIX,
        "app.kubernetes.io/component": site.component,
        "app.kubernetes.io/instance": site.object_name,
    }
    if region:
        labels["fedgrid.dev/region"] = region
    return labels


def _selector(site: Site) -> dict[str, str]:
    return {
        k: v
        for k, v in _labels(site).items()
        if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")
    }


def _probe(site: Site, client_cert: str, *, period: int, failures: int) -> dict[str, Any]:
    """``fedgrid health`` against the pod's own gRPC port with a client certificate of the CA."""
    command = [
        "fedgrid",
        "health",
        f"127.0.0.1:{GRPC_PORT}",
        "--server-name",
        site.server_name,
        *_certs(f"{client_cert}.pem", f"{client_cert}.key").flags(),
    ]
    return {
        "exec": {"command": command},
        "periodSeconds": period,
        "timeoutSeconds": 10,
        "failureThreshold": failures,
    }


def _pod(
    site: Site,
    args: Sequence[str],
    *,
    image: str,
    probe_cert: str = "",
    data: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod template's spec: the site's one container, its Secret, its writable directories."""
    container: dict[str, Any] = {
        "name": site.component,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": list(args),
        # The root filesystem is read-only: caches (torch's, a plugin's) go to /tmp, not ~/.cache.
        "env": [{"name": "XDG_CACHE_HOME", "value": "/tmp/cache"}],
        "volumeMounts": [
            {"name": "certs", "mountPath": CERTS_DIR, "readOnly": True},
            {"name": "data", "mountPath": DATA_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": resources or RESOURCES[site.component],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if probe_cert:  # a server: its port, and probes of its health service
        container["ports"] = [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}]
        # Up to 3 minutes to start (torch's import, a checkpoint to restore); then ready while it
        # answers SERVING, restarted after a minute of no answer.
        container["startupProbe"] = _probe(site, probe_cert, period=5, failures=36)
        container["readinessProbe"] = _probe(site, probe_cert, period=10, failures=3)
        container["livenessProbe"] = _probe(site, probe_cert, period=20, failures=3)
    volumes: list[dict[str, Any]] = [
        # 0440 with fsGroup: readable by the image's user, whoever the kubelet makes owner.
        {"name": "certs", "secret": {"secretName": site.secret, "defaultMode": 0o440}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    if data is not None:
        volumes.insert(1, {"name": "data", **data})
    return {
        # No Service environment variables: Kubernetes would set FEDGRID_GLOBAL_PORT and the like,
        # and FEDGRID_* is where fedgrid reads its settings from.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # fedgrid never calls the Kubernetes API
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }


def _service(site: Site, region: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": site.object_name, "labels": _labels(site, region)},
        "spec": {
            "selector": _selector(site),
            "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }


def _address(site: Site) -> str:
    return f"{site.object_name}:{GRPC_PORT}"


def _coordinator(top: Topology, site: Site, *, image: str) -> list[dict[str, Any]]:
    args = coordinator_argv(
        top,
        listen=f"0.0.0.0:{GRPC_PORT}",
        out=f"{DATA_DIR}/run",
        state_dir=f"{DATA_DIR}/state",
        tls=_certs("global.pem", "global.key"),
    ) + ["--crl", f"{CERTS_DIR}/crl.pem"]
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": site.object_name, "labels": _labels(site)},
        "spec": {
            # Its own Service: a ClusterIP (a stable address across the pod's restarts, what the
            # regions dial), not a headless one; a single pod needs no per-pod DNS name.
            "serviceName": site.object_name,
            "replicas": 1,  # one coordinator per federation: its state is the run
            "selector": {"matchLabels": _selector(site)},
            "template": {
                "metadata": {"labels": _labels(site)},
                "spec": _pod(site, args, image=image, probe_cert="probe"),
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data", "labels": _labels(site)},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": STATE_STORAGE}},
                    },
                }
            ],
            # The run's state and final model outlive `kubectl delete -f DIR`: delete the claim yourself.
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
        },
    }
    return [_service(site), statefulset]


def _region(
    top: Topology, region: RegionSpec, site: Site, upstream: Site, *, image: str
) -> list[dict[str, Any]]:
    args = region_argv(
        top,
        region,
        upstream=_address(upstream),
        listen=f"0.0.0.0:{GRPC_PORT}",
        out=f"{DATA_DIR}/run",
        state_dir=f"{DATA_DIR}/state",
        tls=_certs(f"{region.name}-lan.pem", f"{region.name}-lan.key"),
        upstream_tls=_certs(f"{region.name}.pem", f"{region.name}.key"),
    ) + ["--crl", f"{CERTS_DIR}/crl.pem"]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": site.object_name, "labels": _labels(site, region.name)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _selector(site)},
            "template": {
                "metadata": {"labels": _labels(site, region.name)},
                # Its state in an emptyDir: kept across the container's restarts; a region whose
                # pod moves rejoins under its name and the coordinator sends it the global model.
                "spec": _pod(site, args, image=image, probe_cert=region.name, data={"emptyDir": {}}),
            },
        },
    }
    return [_service(site, region.name), deployment]


def _client(top: Topology, partition: int, site: Site, region: Site, *, image: str) -> list[dict[str, Any]]:
    args = client_argv(
        top,
        partition,
        coordinator=_address(region),
        state_dir=f"{DATA_DIR}/state",
        tls=_certs(f"{site.name}.pem", f"{site.name}.key"),
    )
    pod = _pod(site, args, image=image, data={"emptyDir": {}}, resources=_client_resources(top))
    pod["restartPolicy"] = "OnFailure"
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": site.object_name, "labels": _labels(site, region.name)},
            "spec": {
                "backoffLimit": CLIENT_BACKOFF_LIMIT,
                "template": {"metadata": {"labels": _labels(site, region.name)}, "spec": pod},
            },
        }
    ]


def _client_resources(top: Topology) -> dict[str, Any]:
    """A client's requests and limits: a core per training thread (``[clients] threads``; 0 is
    torch's default, all the node's cores: the defaults), and one more as a limit for gRPC."""
    threads = int(top.client_keys.get("threads", 0))
    resources = RESOURCES["client"]
    if threads < 1:
        return resources
    return {
        "requests": {**resources["requests"], "cpu": str(threads)},
        "limits": {**resources["limits"], "cpu": str(threads + 1)},
    }


def _network_policy() -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{PREFIX}-grpc-only", "labels": {"app.kubernetes.io/part-of": PREFIX}},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/part-of": PREFIX}},
            "policyTypes": ["Ingress"],
            # From anywhere (a region or client may be another cluster's): mutual TLS decides who
            # gets in; nothing but gRPC is reachable. Clients listen on nothing at all.
            "ingress": [{"ports": [{"protocol": "TCP", "port": GRPC_PORT}]}],
        },
    }


def manifests(top: Topology, *, image: str) -> dict[str, list[dict[str, Any]]]:
    """The topology's objects by the file they go in (``coordinator.yaml``, ``region-NAME.yaml``, ...).

    Raises:
        TopologyError: a region name that is no DNS-1123 label (``check_names``).
    """
    check_names(top)
    by_name = {s.name: s for s in sites(top)}
    coordinator = by_name["global"]
    files = {"coordinator.yaml": _coordinator(top, coordinator, image=image)}
    for r in top.regions:
        files[f"region-{r.name}.yaml"] = _region(top, r, by_name[r.name], coordinator, image=image)
    for r in top.regions:
        for p in r.partitions:
            files[f"client-{p}.yaml"] = _client(top, p, by_name[f"client-{p}"], by_name[r.name], image=image)
    files["network-policy.yaml"] = [_network_policy()]
    return files


def secrets_script(top: Topology) -> str:
    """``secrets.sh``: issues what is missing in ``$PKI`` (``fedgrid certs``), then makes each site's Secret."""
    all_sites = sites(top)
    lines = [
        "#!/bin/sh",
        "# The Secrets that the manifests beside this file mount, one per site: the CA certificate and",
        "# the site's own certificates and keys (servers: the revocation list too), never the CA's key.",
        "# Run it where the federation's CA lives, with fedgrid and kubectl (its context and namespace:",
        "# where you apply the manifests):",
        "#",
        "#   PKI=pki sh secrets.sh",
        "#",
        "# It makes the CA in $PKI if there is none, issues each certificate that is missing there",
        "# (servers name their Service, which their peers dial), and creates or updates each Secret.",
        "set -eu",
        'PKI="${PKI:-pki}"',
        '[ -f "$PKI/ca.pem" ] || fedgrid certs init --dir "$PKI" --name "fedgrid federation CA"',
        'issue() { [ -f "$PKI/$1.pem" ] || fedgrid certs issue --dir "$PKI" --name "$@"; }',
    ]
    issued: list[str] = []
    for site in all_sites:
        if site.component == "coordinator":
            issued += [f"issue global --server --san {site.server_name}", "issue probe"]
        elif site.component == "region":
            issued += [f"issue {site.name}-lan --server --san {site.server_name}", f"issue {site.name}"]
        else:
            issued.append(f"issue {site.name}")
    lines += issued
    for site in all_sites:
        sources = " ".join(f'--from-file={f}="$PKI/{f}"' for f in site.files)
        lines.append(
            f"kubectl create secret generic {shlex.quote(site.secret)} {sources} "
            "--dry-run=client -o yaml | kubectl apply -f -"
        )
    return "\n".join(lines) + "\n"


def _check_image(image: str) -> None:
    if not image or any(c.isspace() for c in image):
        raise ConfigError("image", f"must be a container image reference (REGISTRY/NAME:TAG), got {image!r}")


def emit(top: Topology, out: Path, *, image: str) -> list[Path]:
    """Writes the topology's manifests and ``secrets.sh`` into ``out`` (new or empty), all or nothing.

    Returns:
        The files written, in ``out``.
    Raises:
        TopologyError: a region name that makes no valid object name; nothing is written.
        ConfigError: ``image`` is no image reference, or ``out`` is a file or not empty (stale
            manifests there would be applied too); nothing is written.
    """
    import yaml  # the k8s extra: only this command needs it

    _check_image(image)
    texts = {
        name: yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)
        for name, objects in manifests(top, image=image).items()
    }
    texts["secrets.sh"] = secrets_script(top)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            "out",
            f"{out} is not an empty directory: give a new one (stale manifests in it would be applied too)",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside it, then renamed into place: a failure leaves no half-written directory.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, text in texts.items():
            (staging / name).write_text(text)
        (staging / "secrets.sh").chmod(0o755)
        staging.chmod(0o755)
        os.replace(staging, out)  # replaces an empty directory too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out / name for name in texts]
