"""The sites tier's engine, image and reference run, made once per session.

- ``preparation``: when the session runs a test that needs the engine or the image, both are
  made in a thread from the session's start (``Preparation``), so that the lab's tests, which
  run first and need neither, run beside the engine's install, the base and the build (minutes
  on a machine with no images) instead of before them.
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
import threading
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


#: The fixtures whose tests need the engine (and, but for ``engine``, the image).
NEEDS_ENGINE = frozenset({"engine", "image", "federation"})


class Preparation:
    """The engine, then the base and the image, made in a thread of their own: ``engine_ready``
    is set once the engine answers (or cannot: ``error``), and the thread ends once the image is
    built (or could not be: ``build_error``), ``built_s`` seconds after the engine was ready."""

    def __init__(self, folder: Path) -> None:
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.build_error: BaseException | None = None
        self.built_s = 0.0
        self.engine_ready = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(folder,), name="fedgrid-sites-prepare", daemon=True
        )
        self.thread.start()

    def _run(self, folder: Path) -> None:
        try:
            self.engine = Engine.ensure(folder / "dockerd.log")
            left = remove_leftovers()
            if left:
                print(f"removed what an earlier run left: {', '.join(left)}")
        except BaseException as exc:  # handed to the engine fixture
            self.error = exc
            return
        finally:
            self.engine_ready.set()
        started = time.monotonic()
        try:
            build_image(IMAGE, base=base_image(), log=folder / "build.log")
        except BaseException as exc:  # handed to the image fixture
            self.build_error = exc
        self.built_s = time.monotonic() - started


@pytest.fixture(scope="session", autouse=True)
def preparation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Preparation | None]:
    if not any(NEEDS_ENGINE & set(getattr(item, "fixturenames", ())) for item in request.session.items):
        yield None  # the lab's tests alone: no engine, no image
        return
    prep = Preparation(tmp_path_factory.mktemp("engine"))
    try:
        yield prep
    finally:
        prep.thread.join(timeout=1200)  # the build is not cut off under the engine
        if prep.engine is not None:
            prep.engine.stop()


@pytest.fixture(scope="session")
def engine(preparation: Preparation | None) -> Engine:
    assert preparation is not None
    preparation.engine_ready.wait()
    if isinstance(preparation.error, EngineUnavailable):
        pytest.skip(f"the sites tier needs a Docker engine: {preparation.error}")
    if preparation.error is not None:
        raise preparation.error
    assert preparation.engine is not None
    return preparation.engine


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
def image(engine: Engine, reference: Reference, preparation: Preparation | None) -> str:
    assert preparation is not None
    waited = time.monotonic()
    preparation.thread.join()
    if preparation.build_error is not None:
        raise preparation.build_error
    print(
        f"{IMAGE}: {image_size(IMAGE) / 1e9:.3f} GB, base and build {preparation.built_s:.0f} s "
        f"(waited for {time.monotonic() - waited:.0f} s of it)"
    )
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
