"""docker/'s per-site kit run for real on a Docker engine (``make test-sites``; issue 38, item 1).

certs.yaml, global.yaml, two region.yaml and six client.yaml (the two regions of three clients
of docker/topology.toml: region.yaml's ``--min-clients 3`` needs three) run unchanged, each site
its own compose project, volumes and .env, reaching the others at this host's address and their
published ports, over mutual TLS with certificates that name that address. The federation comes
up, trains and ends on the model ``fedgrid launch docker/topology.toml`` gives on this machine
for the same seeds, bit for bit (same torch build, one thread everywhere); with a region killed
and restarted and a client cut off its network for 30 s, too, each round run once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from docker_engine import build_layer, docker, image_size
from docker_sites import Federation, Site, state
from safetensors.torch import load_file

import fedgrid
from fedgrid.runlog import read_metrics

RUN = "/var/lib/fedgrid/run"
ROUNDS, REGIONAL_ROUNDS = 10, 2  # global.yaml's --rounds and region.yaml's --regional-rounds
OTHER_VERSION = "0.0.0+other"


def _same_model(got: Path, want: Path) -> None:
    a, b = load_file(got), load_file(want)
    assert sorted(a) == sorted(b)
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"tensors that differ from fedgrid launch's: {differ}"


def _run_of(fed: Federation, name: str, service: str, into: Path) -> Path:
    """The site's run directory (its metrics and, for the coordinator, its model), copied out."""
    into.mkdir(parents=True)
    fed.read(name, service, f"{RUN}/metrics.jsonl", into / "metrics.jsonl")
    if service == "coordinator":
        fed.read(name, service, f"{RUN}/model.safetensors", into / "model.safetensors")
    return into


def _check_rounds(fed: Federation, tmp_path: Path) -> Path:
    """Every round of every tier ran once, all its clients in; the coordinator's run directory."""
    top = _run_of(fed, "global", "coordinator", tmp_path / "global")
    assert [(m["round"], m["clients_ok"], m["clients_failed"]) for m in read_metrics(top)] == [
        (r, 2, 0) for r in range(1, ROUNDS + 1)
    ]
    for region in ("region-a", "region-b"):
        lan = read_metrics(_run_of(fed, region, "region", tmp_path / region))
        assert [(m["round"], m["clients_ok"]) for m in lan] == [
            (r, 3) for r in range(1, ROUNDS * REGIONAL_ROUNDS + 1)
        ], region
    return top


def _rounds_done(fed: Federation, name: str, service: str) -> int:
    """Rounds in the service's metrics.jsonl now (0 before the first, or while it is down)."""
    done = docker("exec", fed.sites[name].container(service), "cat", f"{RUN}/metrics.jsonl", check=False)
    return len(done.stdout.splitlines()) if done.returncode == 0 else 0


def test_a_site_missing_a_variable_is_named_before_any_container_starts(engine, tmp_path):
    full = {
        "FEDGRID_IMAGE": "fedgrid:sites",
        "GLOBAL_HOST": "192.0.2.1",
        "GLOBAL_PORT": "50051",
        "REGION": "region-a",
        "REGION_HOST": "192.0.2.2",
        "REGION_PORT": "50051",
        "CLIENT": "client-0",
        "PARTITION": "0/6",
    }
    for role, missing in (("global", "GLOBAL_HOST"), ("region", "REGION_HOST"), ("client", "PARTITION")):
        folder = tmp_path / role
        folder.mkdir()
        (folder / ".env").write_text("".join(f"{k}={v}\n" for k, v in full.items() if k != missing))
        site = Site(role, role, f"fgsites-bad-{role}", folder, {})
        done = site.compose("up", "-d", "--no-build", "--pull", "never", check=False)
        assert done.returncode != 0
        assert f"set {missing} in docker/.env" in done.stderr.decode(), done.stderr
        label = f"label=com.docker.compose.project={site.project}"
        for listing in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
            assert docker(*listing, "-q", "--filter", label).stdout == "", (role, listing)


def test_the_image_is_cpu_torch_without_build_tools_as_its_own_user(image):
    probe = (
        "import importlib.metadata as m, shutil, torch, fedgrid, os, pathlib;"
        "print(torch.__version__, torch.version.cuda, fedgrid.__version__, os.getuid());"
        "print(sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith('nvidia')));"
        "print([t for t in ('gcc', 'cc', 'c++', 'g++', 'make', 'ld', 'as', 'cmake', 'protoc') if shutil.which(t)]);"
        "print([p for p in ('/usr/include/python3.11', os.path.dirname(torch.__file__) + '/include') if os.path.exists(p)]);"
        "print(len(list(pathlib.Path('/var/lib/apt/lists').glob('*Packages*'))))"
    )
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", probe).stdout
    assert out.splitlines() == [f"2.13.0+cpu None {fedgrid.__version__} 10001", "[]", "[]", "[]", "0"]
    size = image_size(image)
    print(f"{image}: {size / 1e9:.3f} GB ({size / 2**30:.3f} GiB)")


def test_the_sites_train_and_end_on_the_model_fedgrid_launch_gives(federation, reference, image, tmp_path):
    fed = federation("run")
    started = time.monotonic()
    # Before the federation's clients (the run waits for them), a client site whose image is
    # another fedgrid release: refused at Join.
    fed.start(clients=False)
    other = f"{image}-other"
    build_layer(
        other,
        f"FROM {image}\nUSER root\nRUN sed -i 's/^Version: .*/Version: {OTHER_VERSION}/' "
        "/opt/venv/lib/python3*/site-packages/fedgrid-*.dist-info/METADATA\nUSER fedgrid\n",
    )
    fed.add(
        "client-other",
        "client",
        FEDGRID_IMAGE=other,
        CLIENT="client-other",
        PARTITION="0/6",
        **fed.lan("region-a"),
    )
    fed.load("client-other")
    fed.up("client-other")
    refusal = (
        f"fedgrid version mismatch: the client runs fedgrid '{OTHER_VERSION}', the coordinator "
        f"fedgrid {fedgrid.__version__}"
    )
    site = fed.sites["client-other"]
    fed.wait_until(
        lambda: refusal in site.compose("logs", "--no-color", "client").stdout.decode(),
        timeout=240,
        what="the other release's client to be refused",
    )
    site.compose("down", "-v", "-t", "5")
    fed.start_clients()

    states = fed.wait_finished(timeout=600)
    print(
        f"the federation of compose sites: {time.monotonic() - started:.0f} s from the certs step to its end"
    )
    assert {n: (s["ExitCode"], s["RestartCount"]) for n, s in states.items()} == {
        n: (0, 0) for n, _ in fed.topology
    }
    top = _check_rounds(fed, tmp_path)
    launched = reference.run()
    _same_model(top / "model.safetensors", launched / "model.safetensors")
    assert [m["loss"] for m in read_metrics(top)] == [m["loss"] for m in read_metrics(launched)]


def test_a_killed_region_and_a_client_cut_off_for_30_s_end_on_the_same_model(federation, reference, tmp_path):
    """client-4 (region-b's) loses its network after global round 1: region-b, and so the global
    round, wait for it. Meanwhile region-a is killed, in that open round, and started again
    (``docker start``: its state volume, its address). 30 s after the cut the client is reconnected."""
    fed = federation("faults")
    fed.start()
    client = fed.sites["client-4"].container("client")
    network = next(iter(json.loads(docker("inspect", client).stdout)[0]["NetworkSettings"]["Networks"]))
    fed.wait_until(
        lambda: _rounds_done(fed, "global", "coordinator") >= 1,
        timeout=300,
        what="global round 1",
        interval=0.2,  # an unloaded machine runs a global round in about half a second
    )
    docker("network", "disconnect", network, client)
    cut = time.monotonic()
    cut_after = _rounds_done(fed, "global", "coordinator")
    assert cut_after < ROUNDS, "the run ended before the faults: they prove nothing"
    region = fed.sites["region-a"].container("region")
    docker("kill", region)
    fed.wait_until(lambda: state(region)["Status"] == "exited", timeout=60, what="region-a to die")
    print(f"client-4 cut off and region-a killed after global round {cut_after}")
    docker("start", region)
    fed.wait_healthy("region-a", "region", timeout=300)
    # The fault is 30 s long: what it holds up is waited on below, on its own conditions.
    time.sleep(max(0.0, 30 - (time.monotonic() - cut)))
    docker("network", "connect", network, client)

    states = fed.wait_finished(timeout=600)
    assert {n: s["ExitCode"] for n, s in states.items()} == {n: 0 for n, _ in fed.topology}
    top = _check_rounds(fed, tmp_path)
    _same_model(top / "model.safetensors", reference.run() / "model.safetensors")
    assert "resum" in fed.sites["region-a"].compose("logs", "--no-color", "region").stdout.decode()
