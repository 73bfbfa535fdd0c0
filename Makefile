# Two commands: `make demo` runs a federated training, `make test` runs the tests (every tier but docs and sites);
# `make test-fast` runs the unit and integration tiers, `make test-docs` every docs command marked to run, as
# written, `make test-sites` the docker kit on a real Docker engine (as root; CI runs both after `make test`),
# `make docs` builds the documentation into build/docs/.
# Both create .venv when it is missing and install what is needed first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-docs test-sites lint docs install proto proto-check bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 (CPU) lies on disk here; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedgrid simulate --out runs/demo

# Generated code up to date, formatting and lint (ruff), types. The layer contracts (pyproject.toml
# [tool.importlinter]) are checked by tests/e2e/test_layers.py.
lint: $(STAMP)
	$(PY) -m fedgrid.proto.generate --check
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Every tier but docs and sites (tests/conftest.py: unit, integration, e2e, examples) on two pytest-xdist workers; the
# tests that share the reference deployment run on one of them, so it is made once.
# The status page's test renders it in headless Chromium (Debian's package): installed here
# when missing and running as root (CI); elsewhere the test says why it is skipped.
test: lint
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --ignore=tests/docs --ignore=tests/sites tests

# The sites tier: docker/'s per-site compose files on a real Docker engine, one project per site.
# As root it installs Debian's docker.io and debootstrap when missing, starts dockerd when no
# engine answers (and stops it after), and builds docker/Dockerfile (tests/support/docker_engine.py).
# The base and the image's layers stay in the engine: a second run takes minutes less.
# The lab's hosts and links (fedgrid.ops.lab) need iproute2 and iptables: installed here as root
# when missing, so that a fresh machine runs the lab's tests instead of skipping them.
test-sites: $(STAMP)
	[ "$$(id -u)" != 0 ] || (command -v iptables >/dev/null && command -v tc >/dev/null) || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iptables iproute2)
	$(PY) -m pytest -q -p no:cacheprovider -s tests/sites

# The docs tier: every shell block of docs/*.rst and README.md marked `.. check: runs`, run as written from a
# copy of the repository's root, each in under 3 minutes on a 2-core CPU (tests/docs/test_docs_commands.py).
test-docs: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests/docs

# The development loop: unit and integration tiers (no subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit tests/integration

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs build/docs

proto: $(STAMP)
	$(PY) -m fedgrid.proto.generate

bench: $(STAMP)
	$(PY) benchmarks/transport.py

clean:
	rm -rf $(VENV) runs build *.egg-info
