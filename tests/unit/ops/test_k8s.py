"""``fedgrid launch --emit k8s``: docker/topology.toml as Kubernetes manifests.

No cluster runs here: every object ``--emit k8s`` writes is validated offline against
Kubernetes' own schemas (``kubernetes-validate``, 1.37, strict: no field the API does not
have), then read for what a schema cannot see: the ports, addresses, claims, Secrets and
probes tie the objects together as the topology says. A bad topology or name writes nothing.
(The Secrets script, run with the real ``fedgrid certs``: tests/e2e/test_k8s_secrets.py.)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fedgrid.cli import build_parser, main
from fedgrid.ops.health import _flags as health_flags
from fedgrid.ops.k8s import CERTS_DIR, GRPC_PORT, UID, manifests, secrets_script
from fedgrid.ops.topology import load_topology

ROOT = Path(__file__).resolve().parents[3]
TOPOLOGY = ROOT / "docker" / "topology.toml"
KUBERNETES = "1.37"


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """What ``fedgrid launch --emit k8s`` writes for docker/topology.toml, read back as kubectl reads it."""
    out = tmp_path_factory.mktemp("k8s") / "manifests"
    assert (
        main(
            ["launch", "--emit", "k8s", "--out", str(out), "--image", "reg.example/fedgrid:1", str(TOPOLOGY)]
        )
        == 0
    )
    files = {p.name: [o for o in yaml.safe_load_all(p.read_text()) if o] for p in sorted(out.glob("*.yaml"))}
    return out, files


def _objects(files: dict[str, list[dict]]) -> dict[tuple[str, str], dict]:
    objects = {(o["kind"], o["metadata"]["name"]): o for objs in files.values() for o in objs}
    assert len(objects) == sum(len(objs) for objs in files.values())  # no two objects of one name
    return objects


def _pair(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _workloads(objects: dict[tuple[str, str], dict]) -> dict[str, dict]:
    return {name: o for (kind, name), o in objects.items() if kind in ("StatefulSet", "Deployment", "Job")}


def _secrets(script: str) -> dict[str, set[str]]:
    """secrets.sh's Secrets: name -> the keys (file names) it creates it with."""
    found = re.findall(r"^kubectl create secret generic (\S+) (.*?) --dry-run", script, re.M)
    return {name: set(re.findall(r"--from-file=([^=]+)=", sources)) for name, sources in found}


def test_every_manifest_is_valid_for_kubernetes_1_37_strict(emitted):
    out, files = emitted
    assert sorted(files) == [
        "client-0.yaml",
        "client-1.yaml",
        "client-2.yaml",
        "client-3.yaml",
        "client-4.yaml",
        "client-5.yaml",
        "coordinator.yaml",
        "network-policy.yaml",
        "region-region-a.yaml",
        "region-region-b.yaml",
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "secrets.sh"])
    for objs in files.values():
        for o in objs:
            assert kubernetes_validate.validate(o, KUBERNETES, strict=True) == KUBERNETES
    # What is on disk is what the module builds (the YAML is a faithful dump).
    top = load_topology(TOPOLOGY)
    assert files == manifests(top, image="reg.example/fedgrid:1")
    # No private key in any file: the Secrets are made from the CA's directory by secrets.sh.
    for p in out.iterdir():
        assert "PRIVATE KEY" not in p.read_text(), p.name


def test_the_validator_is_strict():
    """A misspelt field and a wrong type fail: strict validation is no rubber stamp."""
    top = load_topology(TOPOLOGY)
    statefulset = manifests(top, image="fedgrid:1")["coordinator.yaml"][1]
    misspelt = {**statefulset, "spec": {**statefulset["spec"], "replica": 1}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(misspelt, KUBERNETES, strict=True)
    wrong = {**statefulset, "spec": {**statefulset["spec"], "replicas": "one"}}
    with pytest.raises(kubernetes_validate.ValidationError, match="one"):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


def test_the_objects_are_the_topology(emitted):
    """A StatefulSet for the coordinator, a Deployment and a Service per region, a Job per client;
    each region dials the coordinator's Service, each client its own region's, on the gRPC port."""
    _, files = emitted
    objects = _objects(files)
    top = load_topology(TOPOLOGY)
    kinds = sorted(objects)
    assert kinds == sorted(
        [
            ("StatefulSet", "fedgrid-global"),
            ("Service", "fedgrid-global"),
            ("NetworkPolicy", "fedgrid-grpc-only"),
            *(("Deployment", f"fedgrid-{r.name}") for r in top.regions),
            *(("Service", f"fedgrid-{r.name}") for r in top.regions),
            *(("Job", f"fedgrid-client-{p}") for r in top.regions for p in r.partitions),
        ]
    )
    workloads = _workloads(objects)
    services = {name: o for (kind, name), o in objects.items() if kind == "Service"}
    parser = build_parser()

    def container(name: str) -> dict:
        (c,) = workloads[name]["spec"]["template"]["spec"]["containers"]
        return c

    # Each Service selects exactly its own workload's pods, on the port they listen on.
    for name, service in services.items():
        (port,) = service["spec"]["ports"]
        assert (port["port"], port["protocol"], port["targetPort"]) == (GRPC_PORT, "TCP", "grpc")
        selected = [
            w
            for w, o in workloads.items()
            if service["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected == [name]
        c = container(name)
        assert c["ports"] == [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}]
        assert _pair(c["args"], "--listen") == f"0.0.0.0:{GRPC_PORT}"
    assert workloads["fedgrid-global"]["spec"]["serviceName"] == "fedgrid-global"

    coordinator = container("fedgrid-global")["args"]
    assert coordinator[0] == "coordinator"
    assert (
        _pair(coordinator, "--rounds") == "10"
        and _pair(coordinator, "--region-codecs") == "region-a=int8,region-b=int8"
    )
    for r in top.regions:
        args = container(f"fedgrid-{r.name}")["args"]
        assert args[:3] == ["region", "--name", r.name]
        assert _pair(args, "--upstream") == f"fedgrid-global:{GRPC_PORT}"  # the coordinator's Service
        assert _pair(args, "--regional-rounds") == "2" and _pair(args, "--codec") == "bf16"
        assert workloads[f"fedgrid-{r.name}"]["spec"]["strategy"] == {"type": "Recreate"}
        for p in r.partitions:
            job = workloads[f"fedgrid-client-{p}"]
            args = container(f"fedgrid-client-{p}")["args"]
            assert args[0] == "client"
            assert _pair(args, "--coordinator") == f"fedgrid-{r.name}:{GRPC_PORT}"  # its region's Service
            assert _pair(args, "--partition") == f"{p}/{top.num_partitions}"
            assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
            assert "ports" not in container(f"fedgrid-client-{p}")  # a client opens no port
    for name in workloads:
        parser.parse_args(container(name)["args"])  # exits (fails the test) on a flag fedgrid lacks
        assert container(name)["image"] == "reg.example/fedgrid:1"


def test_the_coordinator_keeps_its_state_dir_on_its_claim(emitted):
    _, files = emitted
    statefulset = _objects(files)[("StatefulSet", "fedgrid-global")]
    spec = statefulset["spec"]
    assert spec["replicas"] == 1
    (claim,) = spec["volumeClaimTemplates"]
    assert (
        claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        and claim["spec"]["resources"]["requests"]["storage"]
    )
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert claim["metadata"]["name"] not in {v["name"] for v in pod["volumes"]}  # the claim, not a pod volume
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    for flag in ("--state-dir", "--out"):
        assert Path(mount["mountPath"]) in Path(_pair(c["args"], flag)).parents, flag
    assert mount.get("readOnly") is not True


def test_every_mount_is_a_volume_and_every_secret_a_site_of_secrets_sh(emitted):
    out, files = emitted
    secrets = _secrets((out / "secrets.sh").read_text())
    workloads = _workloads(_objects(files))
    assert sorted(secrets) == sorted(f"{name}-certs" for name in workloads)  # one Secret per site
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert {m["name"] for m in c["volumeMounts"]} == set(volumes) | claims, name
        (secret,) = [v["secret"] for v in volumes.values() if "secret" in v]
        assert secret["secretName"] == f"{name}-certs"
        (certs,) = [m for m in c["volumeMounts"] if volumes.get(m["name"], {}).get("secret")]
        assert certs["mountPath"] == CERTS_DIR and certs["readOnly"] is True
        # Every certificate file the container and its probes name is a key of its own Secret.
        probes = [
            c[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c
        ]
        named = {a for a in [*c["args"], *(a for p in probes for a in p)] if a.startswith(CERTS_DIR + "/")}
        assert named and {Path(a).name for a in named} <= secrets[secret["secretName"]], name
        assert {Path(a).parent for a in named} == {Path(CERTS_DIR)}
    # The key files only where they belong: a client's Secret holds its own key and no one else's.
    assert secrets["fedgrid-client-0-certs"] == {"ca.pem", "client-0.pem", "client-0.key"}
    assert not any("ca.key" in keys for keys in secrets.values())


def test_probes_ask_the_health_service_on_the_grpc_port(emitted):
    _, files = emitted
    objects = _objects(files)
    for name, workload in _workloads(objects).items():
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        probes = [c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        if workload["kind"] == "Job":
            assert probes == [None, None, None]
            continue
        (port,) = c["ports"]
        for probe in probes:
            command = probe["exec"]["command"]
            assert command[:2] == ["fedgrid", "health"]
            args = health_flags(argparse.ArgumentParser()).parse_args(command[2:])
            host, _, number = args.address.rpartition(":")
            assert (host, int(number)) == ("127.0.0.1", port["containerPort"])
            assert args.server_name == name  # what the server certificate names: its Service
            assert args.ca and args.cert and args.key
            assert probe["timeoutSeconds"] >= 5 and probe["failureThreshold"] >= 3
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120


def test_the_network_policy_admits_only_the_grpc_port(emitted):
    _, files = emitted
    objects = _objects(files)
    (policy,) = [o for (kind, _), o in objects.items() if kind == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": GRPC_PORT}]}]
    selector = spec["podSelector"]["matchLabels"].items()
    for name, workload in _workloads(objects).items():
        assert selector <= workload["spec"]["template"]["metadata"]["labels"].items(), name


def test_pods_run_as_the_images_user_without_privileges(emitted):
    _, files = emitted
    for name, workload in _workloads(_objects(files)).items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == UID and pod["securityContext"]["fsGroup"] == UID
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"
        }  # Pod Security: restricted
        (c,) = pod["containers"]
        context = c["securityContext"]
        assert (context["runAsNonRoot"], context["runAsUser"], context["allowPrivilegeEscalation"]) == (
            True,
            UID,
            False,
        )
        assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
        # Writable: only the data directory and /tmp (the root filesystem is read-only).
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"/var/lib/fedgrid", "/tmp"}, name
        assert {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"} in c["env"]  # caches under /tmp
        assert set(c["resources"]) == {"requests", "limits"}
        assert set(c["resources"]["requests"]) == set(c["resources"]["limits"]) == {"cpu", "memory"}


BAD_NAME = """
[global]
rounds = 2

[[regions]]
name = "{name}"
clients = 1
"""


@pytest.mark.parametrize("name", ["Region_A", "eu.west", "-eu", "r" * 56])
def test_a_name_kubernetes_refuses_is_named_and_nothing_is_written(tmp_path, capsys, name):
    topology = tmp_path / "t.toml"
    topology.write_text(BAD_NAME.format(name=name))
    load_topology(topology)  # a valid topology for fedgrid launch: only Kubernetes refuses the name
    out = tmp_path / "out"
    assert main(["launch", "--emit", "k8s", "--out", str(out), str(topology)]) == 2
    err = capsys.readouterr().err
    assert f"key 'regions.{name}.name'" in err and "DNS-1123" in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["t.toml"]


def test_a_region_name_of_55_characters_fits(tmp_path):
    topology = tmp_path / "t.toml"
    topology.write_text(BAD_NAME.format(name="r" * 55))
    objects = manifests(load_topology(topology), image="fedgrid:1")
    service = objects[f"region-{'r' * 55}.yaml"][0]
    assert len(service["metadata"]["name"]) == 63
    assert kubernetes_validate.validate(service, KUBERNETES, strict=True) == KUBERNETES


def test_an_unknown_topology_field_is_named_and_nothing_is_written(tmp_path, capsys):
    topology = tmp_path / "t.toml"
    topology.write_text(TOPOLOGY.read_text().replace("[clients]\n", "[clients]\ntreads = 2\n"))
    out = tmp_path / "out"
    assert main(["launch", "--emit", "k8s", "--out", str(out), str(topology)]) == 2
    err = capsys.readouterr().err
    assert "key 'clients.treads': unknown key" in err and "threads" in err, err
    assert not out.exists()


def test_a_directory_that_holds_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.yaml").write_text("kind: Old\n")
    assert main(["launch", "--emit", "k8s", "--out", str(out), str(TOPOLOGY)]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["old.yaml"] and (out / "old.yaml").read_text() == "kind: Old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["launch", "--emit", "k8s", "--out", str(empty), str(TOPOLOGY)]) == 0  # an empty one is fine
    assert len(list(empty.glob("*.yaml"))) == 10


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--emit", "k8s"], "config key 'out'"),  # where to write, not a timestamped default
        (["--emit", "k8s", "--out", "{out}", "--image", "fedgrid: 1"], "config key 'image'"),
        (["--out", "{out}", "--image", "fedgrid:1"], "config key 'image': goes with --emit k8s"),
    ],
)
def test_emit_flags_that_do_not_fit_are_named(tmp_path, capsys, argv, key):
    out = tmp_path / "out"
    argv = [a.replace("{out}", str(out)) for a in argv]
    assert main(["launch", *argv, str(TOPOLOGY)]) == 2
    assert key in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_the_secrets_script_issues_each_server_certificate_for_its_service():
    script = secrets_script(load_topology(TOPOLOGY))
    servers = dict(re.findall(r"^issue (\S+) --server --san (\S+)$", script, re.M))
    assert servers == {
        "global": "fedgrid-global",
        "region-a-lan": "fedgrid-region-a",
        "region-b-lan": "fedgrid-region-b",
    }
    clients = re.findall(r"^issue (\S+)$", script, re.M)
    assert clients == ["probe", "region-a", "region-b", *(f"client-{i}" for i in range(6))]


def test_a_client_requests_a_core_per_training_thread(tmp_path):
    topology = tmp_path / "t.toml"
    topology.write_text(
        TOPOLOGY.read_text().replace(
            "[clients]\nnum_partitions = 6\nthreads = 1\n", "[clients]\nnum_partitions = 6\nthreads = 3\n"
        )
    )
    job = manifests(load_topology(topology), image="fedgrid:1")["client-4.yaml"][0]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--threads") + 1] == "3"
    assert (c["resources"]["requests"]["cpu"], c["resources"]["limits"]["cpu"]) == ("3", "4")
    assert kubernetes_validate.validate(job, KUBERNETES, strict=True) == KUBERNETES
