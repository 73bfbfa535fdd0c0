"""No module takes another module's private names (issue 39: "at most 10 private names cross
module boundaries"; the package holds 0). Counted by ``tests/tools/private_census.py``."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS / "tools"))
from private_census import crossings  # noqa: E402


def test_no_private_name_crosses_a_module_boundary():
    found = crossings(TESTS.parent / "src")
    assert {f"{module}.{name}": sorted(users) for (module, name), users in found.items()} == {}


def test_the_census_sees_an_imported_and_an_attribute_private_name(tmp_path):
    package = tmp_path / "fedgrid"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def _helper(): ...\n_TABLE = {}\n__all__ = []\n")
    (package / "sub" / "b.py").write_text("from .a import _helper\n")  # relative
    (package / "c.py").write_text("from fedgrid.sub import a\nfrom fedgrid.sub.a import __all__\na._TABLE\n")
    (package / "sub" / "d.py").write_text(
        "import fedgrid.sub.a as m\n\n\ndef _own(): ...\n\n\nm._helper()\n_own()\n"
    )

    assert crossings(tmp_path) == {
        ("fedgrid.sub.a", "_helper"): {"fedgrid.sub.b", "fedgrid.sub.d"},
        ("fedgrid.sub.a", "_TABLE"): {"fedgrid.c"},
    }
