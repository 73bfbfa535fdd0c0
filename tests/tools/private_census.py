"""Counts the private names that cross module boundaries inside ``src/fedgrid`` (issue 39, item 5).

A private name is one with a single leading underscore (``_pack``, not ``__all__``). It crosses a
boundary when a module other than the one defining it takes it: ``from fedgrid.x import _name``
(relative imports too), or ``m._name`` where ``m`` is a ``fedgrid`` module the user imported
(``import fedgrid.x as m``, ``from fedgrid import x``). Read from the AST, nothing imported.

Prints each crossing name as ``DEFINING_MODULE._name <- USER, ...``, then the number of distinct
crossing names (``defining module, name`` pairs) and of uses (``user, defining module, name``).

Usage: ``python tests/tools/private_census.py [SRC]`` (default: the checkout's ``src``)
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def crossings(src: Path) -> dict[tuple[str, str], set[str]]:
    """``(defining module, private name) -> the modules that take it``."""
    root = src
    modules = {
        _module_name(root, p): p
        for p in sorted((src / "fedgrid").rglob("*.py"))
        if not p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
    }
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for user, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        aliases: dict[str, str] = {}  # a local name -> the fedgrid module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("fedgrid"):
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(user, is_package, node)
                if not source.startswith("fedgrid"):
                    continue
                for a in node.names:
                    if f"{source}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"  # a module
                    elif _private(a.name) and source != user:
                        found[(source, a.name)].add(user)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    source = ".".join([aliases[value.id], *reversed(chain)])
                    if source in modules and source != user:
                        found[(source, node.attr)].add(user)
    return found


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "src"
    result = crossings(src)
    for (source, name), users in sorted(result.items()):
        print(f"{source}.{name} <- {', '.join(sorted(users))}")
    uses = sum(len(u) for u in result.values())
    print(f"{len(result)} private names cross module boundaries ({uses} uses)")
