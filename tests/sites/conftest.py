"""The sites tier's engine, image and reference run, made once per session.

- ``engine``: a Docker engine (``docker_engine.Engine``: Debian's docker.io started here when
  none answers, as root; stopped at the end only if started here). Without root and without an
  engine the tier is skipped, saying so.
- ``image``: docker/Dockerfile built on this machine (``docker_engine.build_image``), reused
  from BuildKit's cache when nothing changed; its size and build time are printed.
- ``reference``: ``fedgrid launch docker/topology.toml`` as local processes, the run the
  federation of compose sites must end on, bit for bit. It starts first, beside the build.
- ``federation``: ``Federation``s under the test's folder; torn down after the test (their
  containers, networks and volumes), their logs printed when the test failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from composefiles import DOCKER
from docker_engine import Engine, EngineUnavailable, base_image, build_image, host_address, image_size
from docker_sites import Federation, remove_leftovers

from harness import child_env

#: The image every site runs (FEDGRID_IMAGE in their .env).
IMAGE = "fedgrid:sites"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    try:
        started = Engine.ensure(tmp_path_factory.mktemp("engine") / "dockerd.log")
    except EngineUnavailable as exc:
        pytest.skip(f"the sites tier needs a Docker engine: {exc}")
    try:
        left = remove_leftovers()
        if left:
            print(f"removed what an earlier run left: {', '.join(left)}")
        yield started
    finally:
        started.stop()


class Reference:
    """``fedgrid launch docker/topology.toml`` running in the background from the session's start."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = out.parent / "launch.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fedgrid.cli", "launch", str(DOCKER / "topology.toml"), "--out", str(out)],
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            env=child_env(),
        )

    def run(self, *, timeout: float = 600) -> Path:
        """The global run directory once the launch ended well."""
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        assert status == 0, self.log.read_text()[-4000:]
        return self.out / "global"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    ref = Reference(tmp_path_factory.mktemp("reference") / "out")
    yield ref
    if ref.process.poll() is None:
        ref.process.kill()
        ref.process.wait(30)


@pytest.fixture(scope="session")
def image(engine: Engine, reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> str:
    started = time.monotonic()
    build_image(IMAGE, base=base_image(), log=tmp_path_factory.mktemp("build") / "build.log")
    print(f"{IMAGE}: {image_size(IMAGE) / 1e9:.3f} GB, built in {time.monotonic() - started:.0f} s")
    return IMAGE


@pytest.fixture
def federation(
    image: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Federation]]:
    made: list[Federation] = []

    def make(run: str) -> Federation:
        fed = Federation(tmp_path / run, image, host_address(), run)
        made.append(fed)
        return fed

    yield make
    failed = any(
        getattr(getattr(request.node, f"report_{w}", None), "failed", False) for w in ("setup", "call")
    )
    for fed in made:
        if failed:
            print(fed.logs(tail=200))
        fed.down()
