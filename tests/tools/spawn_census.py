"""Counts the Python processes a test run starts and what their start-up costs (issue 24).

Usage: ``python tests/tools/spawn_census.py LOG -- PYTEST_ARGS...`` runs
``python -m pytest PYTEST_ARGS`` with a ``sitecustomize`` on ``PYTHONPATH`` that appends one
JSON line to ``LOG`` when any Python process under it starts (its pid, parent and command
line) and one when it exits normally (its CPU seconds and the top-level modules it loaded),
then prints a summary; ``python tests/tools/spawn_census.py LOG`` summarizes a log again.

The summary groups the processes by kind (``fedgrid <command>``, ``-m <module>``, a script)
and prices their start-up: the CPU seconds of a fresh ``python -c "import ..."`` of the
third-party modules a process of that kind loaded (measured once per kind, here), up to the
end of its imports and with its exit (``+exit``), times the number of such processes. Processes that were killed (SIGKILL) write no exit line; they are
priced like the others of their kind.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

SITECUSTOMIZE = """
import atexit, json, os, sys

_LOG = os.environ.get("SPAWN_CENSUS_LOG")


def _line(record):
    with open(_LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


def _exit():
    t = os.times()
    names = sorted({m.split(".")[0] for m in list(sys.modules)})
    _line({"pid": os.getpid(), "exit": True, "cpu": t.user + t.system, "modules": names})


if _LOG:
    _line({"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.orig_argv)})
    atexit.register(_exit)
"""

#: Modules that cost nothing to import or that ``python -c`` loads anyway.
SKIP = set(sys.stdlib_module_names) | {"sitecustomize", "_virtualenv", "__main__", "__mp_main__", "fedgrid"}


def kind(argv: list[str]) -> str:
    """A short name for the process ``argv`` (``sys.orig_argv``) runs."""
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):  # -B, -u, -X importtime
        args = args[2:] if args[0] == "-X" else args[1:]
    if not args:
        return "python"
    if args[:2] == ["-m", "fedgrid.cli"] or Path(args[0]).name == "fedgrid":  # or the console script
        rest = args[2:] if args[0] == "-m" else args[1:]
        return "fedgrid " + next((a for a in rest if not a.startswith("-")), "?")
    if args[0] == "-m":
        return "-m " + args[1]
    if args[0] == "-c":
        return "-c " + (args[1].strip().splitlines() or [""])[0][:40]
    return Path(args[0]).name


def start_and_exit_cpu(modules: list[str]) -> tuple[float, float]:
    """CPU seconds (user + system) of a fresh interpreter importing ``modules``: up to the end of
    the imports, and in all (its exit tears the modules down)."""
    code = (
        "import importlib, os\n"
        f"for m in {modules!r}:\n"
        "    try: importlib.import_module(m)\n"
        "    except Exception: pass\n"
        "t = os.times(); print(t.user + t.system)\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(done.stdout), (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summarize(log: Path) -> None:
    starts, exits = {}, {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        (exits if record.get("exit") else starts)[record["pid"]] = record
    pytest_pids = {p for p, r in starts.items() if "pytest" in " ".join(r["argv"][:3])}
    # pytest-xdist's workers (execnet's bootstrap reads its code from stdin)
    workers = {p for p, r in starts.items() if "exec(eval(sys.stdin" in " ".join(r["argv"])}
    spawned = {p: r for p, r in starts.items() if p not in pytest_pids | workers}
    by_kind: dict[str, list[int]] = defaultdict(list)
    for pid, record in spawned.items():
        by_kind[kind(record["argv"])].append(pid)
    total_cpu = sum(exits[p]["cpu"] for p in spawned if p in exits)
    start_total = whole_total = 0.0
    print(f"{'kind':<44} {'count':>5} {'exited':>6} {'cpu s':>7} {'imports s':>9} {'+exit s':>8}")
    for name, pids in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        seen = [exits[p] for p in pids if p in exits]
        mods = Counter(m for e in seen for m in e["modules"] if m not in SKIP and not m.startswith("_"))
        common = sorted(m for m, n in mods.items() if n * 2 >= len(seen))
        start, whole = start_and_exit_cpu(common) if common else (0.0, 0.0)
        start_total, whole_total = start_total + start * len(pids), whole_total + whole * len(pids)
        cpu = sum(e["cpu"] for e in seen)
        print(
            f"{name:<44} {len(pids):>5} {len(seen):>6} {cpu:>7.1f} {start * len(pids):>9.1f} {whole * len(pids):>8.1f}"
        )
    exited = sum(p in exits for p in spawned)
    print(
        f"{'all':<44} {len(spawned):>5} {exited:>6} {total_cpu:>7.1f} {start_total:>9.1f} {whole_total:>8.1f}"
    )


def main(argv: list[str]) -> int:
    log = Path(argv[0]).resolve()
    if len(argv) > 1:
        if argv[1] != "--":
            raise SystemExit("usage: spawn_census.py LOG [-- PYTEST_ARGS...]")
        log.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory() as site:
            Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
            path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
            env = {**os.environ, "PYTHONPATH": path, "SPAWN_CENSUS_LOG": str(log)}
            subprocess.run([sys.executable, "-m", "pytest", *argv[2:]], env=env)
    summarize(log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
