"""What a newcomer's first hour leaves in the clone: the README's TLS block writes a CA key under
``pki/``, which git must not offer to commit; ``pip install`` of the project warns about nothing
of its own (setuptools deprecated the ``license = { text = ... }`` table)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]


def test_every_certificate_folder_the_readme_makes_is_ignored_by_git():
    folders = set(re.findall(r"fedgrid certs init --dir (\S+)", (ROOT / "README.md").read_text()))
    assert folders == {"pki"}  # the README's TLS block
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert {f"{folder}/" for folder in folders} <= ignored


def test_the_license_is_an_spdx_expression_for_a_setuptools_that_reads_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table is deprecated (a warning per build)
    [setuptools] = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77"  # the first release that reads an SPDX license string
