"""The documentation builds with no warning (``make docs``'s ``sphinx-build -W``), its API
reference is generated from the docstrings, and its README excerpt is the README's.

The full build takes about 10 s on the 2-core machines (autodoc imports every public module).
"""

from __future__ import annotations

import html as htmllib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _text(page: Path) -> str:
    """A page's text: tags dropped (the highlighter wraps every token), entities decoded."""
    return htmllib.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source), str(out)],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_the_docs_build_without_warnings_and_document_the_public_api(tmp_path):
    result = _build(DOCS, tmp_path / "html")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # -q: warnings are all it would print
    html = tmp_path / "html"
    assert sorted(p.name for p in html.glob("*.html")) == [
        "api.html", "concepts.html", "deployment.html", "examples.html", "genindex.html", "index.html", "multigpu.html", "multisite.html",
        "py-modindex.html", "quickstart.html", "regions.html", "search.html",
    ]
    api = (html / "api.html").read_text()
    for anchor in ["fedgrid.client.api.Client", "fedgrid.client.torch_client.TorchClient", "fedgrid.client.runtime.run",
                   "fedgrid.client.session.connect", "fedgrid.client.session.aconnect",
                   "fedgrid.server.app.run_coordinator", "fedgrid.simulation.run.run_simulation", "fedgrid.aggregation.base.Strategy",
                   "fedgrid.aggregation.fedavg.FedAvg", "fedgrid.aggregation.diloco.DiLoCo", "fedgrid.config.load_config",
                   "fedgrid.types.FitIns", "fedgrid.errors.FedgridError", "fedgrid.ops.launch.load_topology", "fedgrid.ops.health.check"]:
        assert f'id="{anchor}"' in api, anchor
    assert "Raises" in api and "Parameters" in api  # napoleon turned Args:/Raises: into fields
    # The multi-site page shows the shipped topology itself (literalinclude), not a copy.
    assert 'region_codecs = "region-a=int8,region-b=int8"' in _text(html / "multisite.html")
    quickstart = _text(html / "quickstart.html")
    assert "fedgrid new myapp" in quickstart
    assert "for task in session.tasks():" in quickstart and "async with aconnect(" in quickstart
    # The deployment commands are included from the README (literalinclude), not copied.
    readme = (DOCS.parent / "README.md").read_text()
    block = readme[readme.index("fedgrid certs init --dir pki"):]
    block = block[: block.index("```")].rstrip()
    assert block.count("\n") >= 5 and block in quickstart


@pytest.mark.timeout(120)
def test_a_warning_fails_the_build(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    (source / "index.rst").write_text("Title\n=====\n\nSee :doc:`no-such-page`.\n")
    result = _build(source, tmp_path / "html")
    assert result.returncode != 0
    assert "unknown document" in result.stderr and "no-such-page" in result.stderr
