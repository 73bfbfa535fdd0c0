"""The test tiers, by folder, and what every tier shares.

- ``unit/``: one process, no sockets; timeout 180 s a test.
- ``integration/``: real gRPC servers in this process, on port 0; 300 s.
- ``e2e/``: other processes (``fedgrid`` commands, torchrun, spawned ranks, the docs build, the
  layer contracts, a browser); 900 s.
- ``examples/``: every program in ``examples/``, run whole; 600 s.
- ``docs/``: every shell block of the documentation marked ``runs``, run as written (each in
  under 3 minutes on a 2-core CPU); 300 s. ``make test-docs`` runs it, after ``make test`` in CI;
  ``make test`` leaves it out (about 4 minutes of CPU time).
- ``sites/``: docker/'s per-site compose kit on a real Docker engine (started from Debian's
  docker.io as root when none answers), built and run whole, and the lab of real hosts and links
  (``fedgrid.ops.lab``: network namespaces, tbf, iptables; root); 900 s. ``make test-sites`` runs it,
  after ``make test`` in CI; ``make test`` leaves it out (it installs packages and builds an image).

Each test gets its folder's marker (``pytest -m unit``) and timeout, so neither is set by hand;
``make test-fast`` runs ``unit`` and ``integration``. ``support/`` holds what the tiers share:
the harness that starts coordinators and clients (forked from a zygote that has imported torch
and the rest once: ``support/zygote.py``; ``FEDGRID_TEST_ZYGOTE=0`` starts real processes), test
clients, attacks and the apps that ``--app`` loads; it is put on ``sys.path`` here.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import pytest

if TYPE_CHECKING:
    import torch

    from harness import InProcessCoordinator

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "support"))

#: Folder under tests/ -> (marker, timeout in seconds).
TIERS = {"unit": 180, "integration": 300, "e2e": 900, "examples": 600, "docs": 300, "sites": 900}


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line(
            "markers", f"{tier}: tests under tests/{tier}/ (applied by tests/conftest.py)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in a tier folder ({', '.join(TIERS)})")
        item.add_marker(getattr(pytest.mark, tier))
        item.add_marker(pytest.mark.timeout(TIERS[tier]))
        if "reference_deployment" in getattr(item, "fixturenames", ()):
            # One xdist worker runs every test that shares the reference run, so it is made once.
            item.add_marker(pytest.mark.xdist_group("reference"))


@pytest.fixture(scope="session")
def reference_deployment(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``get(coordinator_args, clients=, seed=)``: the run directory of an uninterrupted
    deployment (``harness.deploy``), made once per session for each distinct set of arguments,
    so the parity, crash and shutdown tests that compare against the same run share it. Its
    logs are beside it: ``reference.coordinator.log``, ``reference.clientI.log``."""
    from harness import deploy

    made: dict[tuple[tuple[str, ...], int, int], Path] = {}

    def get(coordinator_args: Sequence[str], *, clients: int, seed: int) -> Path:
        key = (tuple(coordinator_args), clients, seed)
        if key not in made:
            made[key] = deploy(
                tmp_path_factory.mktemp("reference"),
                "reference",
                list(coordinator_args),
                clients=clients,
                seed=seed,
            )
        return made[key]

    return get


@pytest.fixture
def small_state() -> "OrderedDict[str, torch.Tensor]":
    import torch

    g = torch.Generator().manual_seed(0)
    return OrderedDict(
        [
            ("layer.weight", torch.randn(4, 3, generator=g)),
            ("layer.bias", torch.randn(4, generator=g)),
            ("steps", torch.tensor(7)),
        ]
    )


@pytest.fixture
def coordinator(small_state) -> Iterator["InProcessCoordinator"]:
    from harness import InProcessCoordinator

    c = InProcessCoordinator(small_state)
    yield c
    c.stop()
