"""The shell blocks of the documentation (``docs/*.rst``, ``README.md``) and how each is checked.

Every shell block carries a mark just before it, so that no command of the docs goes unchecked:

- reStructuredText: a comment line ``.. check: runs`` (the block runs as written, in under 3
  minutes on a 2-core CPU: ``tests/docs/test_docs_commands.py``), ``.. check: run by PATH`` (a
  test at PATH runs it) or ``.. check: not run: REASON`` (a template: a placeholder, another
  machine, Docker, Kubernetes or GPUs), then the ``.. code-block:: sh`` directive;
- Markdown: the same as an HTML comment, ``<!-- check: ... -->``; the quickstart's
  ``<!-- quickstart: runs -->`` is ``run by tests/e2e/test_readme_commands.py``.

``run_block`` runs a block as written, as a user would from the repository's root, in a folder of
its own (``prepare``: the repository's ``examples/`` and ``docker/`` linked in, ``.venv`` the
tests' environment, ``../shared/data`` the machine's data when it has it), in a private network
namespace (the coordinator's default port, 50051, is free there).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELLS = ("sh", "bash", "console", "shell")
#: A line that is a command (not a command's output, ``fedgrid: error: ...``).
COMMAND = re.compile(
    r"^(?:\$ )?(?:fedgrid [a-z-]+(?:\s|$)|python3? |make |docker |pip |torchrun |kubectl |accelerate )"
)
RUNS, RUN_BY, NOT_RUN = "runs", "run by ", "not run: "


@dataclass(frozen=True)
class Block:
    """One shell block: where it is, its mark and its text."""

    page: str
    line: int
    mark: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _rst_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        # A code block other than Python's, or a literal block (``::``), that holds a command.
        found = re.match(r"\s*\.\. code-block:: (\w+)", line)
        literal = line.rstrip().endswith("::") and not line.lstrip().startswith("..")
        if (not found or found.group(1) == "python") and not literal:
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mark = re.match(r"\s*\.\. check: (.*)", lines[j]) if j >= 0 else None
        indent, body, k = None, [], i + 1
        while k < len(lines):
            text = lines[k]
            if text.strip():
                width = len(text) - len(text.lstrip())
                if indent is None:
                    if width == 0:
                        break
                    indent = width
                elif width < indent:
                    break
                body.append(text[indent:])
            elif indent is not None:
                body.append("")
            k += 1
        text = "\n".join(body).strip() + "\n"
        if any(COMMAND.match(t) for t in text.splitlines()):
            out.append(Block(path.name, i + 1, mark.group(1).strip() if mark else "", text))
    return out


def _md_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for found in re.finditer(r"(?:<!-- (.*?) -->\n)?```(\w*)\n(.*?)```", text, re.S):
        if found.group(2) == "python" or not any(COMMAND.match(t) for t in found.group(3).splitlines()):
            continue
        mark = found.group(1) or ""
        mark = "run by tests/e2e/test_readme_commands.py" if mark == "quickstart: runs" else mark
        mark = mark[len("check: ") :] if mark.startswith("check: ") else mark
        out.append(Block(path.name, text[: found.start()].count("\n") + 1, mark, found.group(3)))
    return out


def blocks() -> list[Block]:
    """Every shell block of ``docs/*.rst`` and ``README.md``, in page order."""
    found = [b for page in sorted((ROOT / "docs").glob("*.rst")) for b in _rst_blocks(page)]
    return found + _md_blocks(ROOT / "README.md")


def venv(folder: Path) -> None:
    """``folder/.venv``: the tests' own environment (a venv's activate script), else a stand-in
    that puts the directory of the ``fedgrid`` script on PATH."""
    prefix = Path(sys.prefix)
    if (prefix / "bin" / "activate").is_file():
        (folder / ".venv").symlink_to(prefix, target_is_directory=True)
        return
    script = shutil.which("fedgrid") or str(Path(sys.executable).parent / "fedgrid")
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(script).parent}:$PATH"\n')


def namespaces() -> bool:
    """Whether ``unshare -rn`` gives this user a private network namespace."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True)
    return probe.returncode == 0


def runner(block: str, folder: Path) -> list[str]:
    """The command that runs ``block`` verbatim in a private network namespace, or, without
    one, with port 50051 swapped for a free one."""
    script = folder / "block.sh"
    if namespaces():
        script.write_text(block)
        return ["unshare", "-rn", "sh", "-c", "ip link set lo up && exec bash -e block.sh"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script.write_text(
        block.replace("127.0.0.1:50051", f"127.0.0.1:{port}").replace(
            "fedgrid coordinator ", f"fedgrid coordinator --listen 127.0.0.1:{port} "
        )
    )
    return ["bash", "-e", "block.sh"]


def prepare(folder: Path) -> Path:
    """A folder to run blocks in as from the repository's root: ``folder/repo`` with the
    repository's ``examples`` and ``docker`` linked in, ``.venv``, and ``folder/shared`` the
    machine's ``../shared`` (its data) when there is one."""
    repo = folder / "repo"
    repo.mkdir(parents=True)
    for name in ("examples", "docker", "benchmarks"):
        (repo / name).symlink_to(ROOT / name, target_is_directory=True)
    venv(repo)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (folder / "shared").symlink_to(shared, target_is_directory=True)
    return repo


def run_block(block: Block, repo: Path, timeout: float) -> subprocess.CompletedProcess:
    """Runs ``block`` as written (one bash, ``-e``) in ``repo``, its environment activated."""
    body = block.text if block.text.startswith("source ") else "source .venv/bin/activate\n" + block.text
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        runner(body, repo), cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )
