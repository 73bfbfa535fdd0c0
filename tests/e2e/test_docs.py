"""The documentation builds with no warning (``make docs``'s ``sphinx-build -W``), its API
reference is generated from the docstrings, and ``docs/`` is the single source: nothing in it
includes the README, and the README's quickstart is the docs quickstart's, which runs.

The README is a front door of at most 12 KiB that gives the two set-up commands and links
to the docs pages.

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

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [
    "algorithms",
    "api",
    "architecture",
    "concepts",
    "deployment",
    "determinism",
    "embedding",
    "examples",
    "failures",
    "index",
    "language_models",
    "links",
    "monitoring",
    "multigpu",
    "multisite",
    "privacy",
    "quickstart",
    "regions",
    "reports",
    "running",
    "security",
    "simulation",
    "trainers",
    "updates",
]
# The deployment commands the quickstart shows (mutual TLS end to end, then the same in one process).
DEPLOYMENT = "fedgrid certs init --dir pki"


def _text(page: Path) -> str:
    """A page's text: tags dropped (the highlighter wraps every token), entities decoded."""
    return htmllib.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One build of docs/ for the tests that read it (the build is most of their time). Session
    scope: an xdist worker runs other modules' tests between these two, which would end a
    module-scoped fixture and build again; their xdist group keeps both on one worker."""
    out = tmp_path_factory.mktemp("docs") / "html"
    return _build(DOCS, out), out


@pytest.mark.xdist_group("docs-build")
def test_the_docs_build_without_warnings_and_document_the_public_api(built):
    result, html = built
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""  # -q: warnings are all it would print
    assert sorted(p.name for p in html.glob("*.html")) == sorted(
        [f"{page}.html" for page in PAGES] + ["genindex.html", "py-modindex.html", "search.html"]
    )
    api = (html / "api.html").read_text()
    for anchor in [
        "fedgrid.client.api.Client",
        "fedgrid.client.torch_client.TorchClient",
        "fedgrid.client.runtime.run_client",
        "fedgrid.client.session.connect",
        "fedgrid.client.session.aconnect",
        "fedgrid.server.serve.run_coordinator",
        "fedgrid.simulation.run.run_simulation",
        "fedgrid.aggregation.base.Strategy",
        "fedgrid.aggregation.fedavg.FedAvg",
        "fedgrid.aggregation.diloco.DiLoCo",
        "fedgrid.config.load_config",
        "fedgrid.types.FitIns",
        "fedgrid.errors.FedgridError",
        "fedgrid.ops.launch.load_topology",
        "fedgrid.ops.health.check",
    ]:
        assert f'id="{anchor}"' in api, anchor
    assert "Raises" in api and "Parameters" in api  # napoleon turned Args:/Raises: into fields
    # The multi-site page shows the shipped topology itself (literalinclude), not a copy.
    assert 'region_codecs = "region-a=int8,region-b=int8"' in _text(html / "multisite.html")
    quickstart = _text(html / "quickstart.html")
    assert "fedgrid new myapp" in quickstart
    assert "for task in session.tasks():" in quickstart and "async with aconnect(" in quickstart
    # The deployment commands are the quickstart's own (docs/ is the source, the README links to it).
    block = _rst_code_after(DOCS / "quickstart.rst", DEPLOYMENT)
    assert block.startswith(DEPLOYMENT) and block.count("\n") >= 5 and block in quickstart
    # The 20-line quickstart, on the page as in the README.
    assert _docs_quickstart() in quickstart


def _indented(text: str) -> str:
    """The lines of a code block's body that ``text`` starts with, dedented."""
    lines = []
    for line in text.split("\n"):
        if line and not line.startswith("   "):
            break
        lines.append(line[3:])
    return "\n".join(lines).strip("\n")


def _rst_code_after(page: Path, marker: str) -> str:
    """The rest of the code block of ``page`` whose line holds ``marker``, from that line on."""
    text = page.read_text()
    return _indented(text[text.rindex("\n", 0, text.index(marker)) + 1 :])


def _docs_quickstart() -> str:
    """The Python block under the docs quickstart's "In 20 lines" heading."""
    text = (DOCS / "quickstart.rst").read_text()
    directive = ".. code-block:: python\n"
    return _indented(text[text.index(directive, text.index("In 20 lines\n")) + len(directive) :])


def _readme_quickstart() -> str:
    """The Python block of the README's Quickstart section."""
    text = README.read_text()
    section = text[text.index("\n## Quickstart\n") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    return block[: block.index("```")].rstrip("\n")


def test_nothing_in_docs_reads_the_readme():
    for source in sorted(DOCS.rglob("*")):
        if source.is_file() and source.suffix in {".rst", ".py", ".txt", ".md"}:
            for line in source.read_text().splitlines():
                if re.match(r"\s*\.\. (literalinclude|include)::", line):
                    assert "README" not in line, f"{source.name}: {line.strip()}"
                if source.suffix == ".py":
                    assert "README" not in line, f"{source.name}: {line.strip()}"


def test_the_readme_is_a_front_door_of_at_most_12_kib():
    data = README.read_bytes()
    assert len(data) <= 12_288, f"README.md is {len(data)} bytes"
    text = data.decode()
    commands = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert any(
        re.search(r"^make demo\b", c, re.M) and re.search(r"^make test\b", c, re.M) for c in commands
    ), commands
    assert "make test-fast" in text
    # Every link to a page (docs/..., benchmarks/README.md) leads to a file that exists, and every docs
    # page but the index is linked: the README's feature map is the way into the docs.
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    assert targets and all((ROOT / t).is_file() for t in targets), [
        t for t in targets if not (ROOT / t).is_file()
    ]
    assert {f"docs/{page}.rst" for page in PAGES if page != "index"} <= set(targets)
    # The layout table names the package and every one of its subpackages, by its path under src/.
    layout = text[text.index("\n## Layout\n") :]
    folders = set(re.findall(r"^\| `(src/fedgrid/[a-z_/]*)` \|", layout, re.M))
    package = ROOT / "src" / "fedgrid"
    subpackages = {f"src/fedgrid/{p.parent.name}/" for p in package.glob("*/__init__.py")}
    assert len(subpackages) >= 9 and subpackages | {"src/fedgrid/"} == folders, folders ^ subpackages


def test_the_quickstart_is_the_same_in_the_readme_and_the_docs_and_runs(tmp_path):
    code = _docs_quickstart()
    assert code == _readme_quickstart()  # one program: what the README shows is the docs page's
    assert len(code.splitlines()) <= 20
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=200
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rounds = re.findall(r"^round (\d+): accuracy ([0-9.]+), ([0-9.]+) kB up$", result.stdout, re.M)
    assert [int(r) for r, _, _ in rounds] == [1, 2, 3, 4, 5], result.stdout
    assert float(rounds[-1][1]) > 0.5 and all(float(kb) > 0 for _, _, kb in rounds)
    run_dir = tmp_path / "runs" / "quickstart"
    assert {p.name for p in run_dir.iterdir()} >= {"metrics.jsonl", "model.safetensors", "config.toml"}


def test_a_warning_fails_the_build(tmp_path):
    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(DOCS / "conf.py", source / "conf.py")
    (source / "index.rst").write_text("Title\n=====\n\nSee :doc:`no-such-page`.\n")
    result = _build(source, tmp_path / "html")
    assert result.returncode != 0
    assert "unknown document" in result.stderr and "no-such-page" in result.stderr


@pytest.mark.xdist_group("docs-build")
def test_the_index_lists_pages_and_sections_not_api_objects(built):
    result, html = built
    assert result.returncode == 0, result.stdout + result.stderr
    index = (html / "index.html").read_text()
    toc = index[index.index('<div class="toctree-wrapper') :]
    toc = toc[: toc.index("</div>")]
    links = re.findall(r'<a class="reference internal"[^>]*>(.*?)</a>', toc)
    entries = [htmllib.unescape(re.sub(r"<[^>]+>", "", e)) for e in links]
    assert "API reference" in entries and "Regions" in entries and "Client SDK" in entries  # pages, a section
    # An object's entry is its name as code (regions.rst documents fedgrid.region.region at its top).
    assert not [e for e, link in zip(entries, links) if "<code" in link], entries
    assert "UPSTREAM_RETRY_MAX_S" not in entries and "run_region()" not in entries


def test_every_shell_block_of_the_docs_is_marked_with_how_it_is_checked():
    """Each shell block says how it is checked (``support/doc_blocks.py``): ``runs`` (``make
    test-docs`` runs it as written), ``run by PATH`` (that test runs it) or ``not run: WHY``."""
    from doc_blocks import NOT_RUN, RUN_BY, RUNS, blocks

    found = blocks()
    unmarked = [b.id for b in found if not b.mark]
    assert not unmarked, f"shell blocks without a '.. check:' mark (tests/support/doc_blocks.py): {unmarked}"
    for b in found:
        assert b.mark == RUNS or b.mark.startswith((RUN_BY, NOT_RUN)), (b.id, b.mark)
        if b.mark.startswith(NOT_RUN):
            assert len(b.mark) > len(NOT_RUN) + 10, f"{b.id}: say why it is not run"
        if b.mark.startswith(RUN_BY):
            test = b.mark[len(RUN_BY) :].split()[0]
            assert (ROOT / test).is_file(), f"{b.id}: {test} does not exist"
    running = [b.id for b in found if b.mark == RUNS]
    assert len(running) >= 10 and any(i.startswith("trainers.rst:") for i in running), running
