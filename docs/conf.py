"""Sphinx configuration: ``make docs`` builds the HTML into ``build/docs`` (warnings are errors)."""

from __future__ import annotations

from importlib.metadata import version as _version

project = "fedgrid"
author = "the fedgrid authors"
copyright = "the fedgrid authors, Apache-2.0"
release = _version("fedgrid")
version = ".".join(release.split(".")[:2])

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"page_width": "1100px", "body_max_width": "none"}
html_static_path: list[str] = []

# Docstrings are Google style (Args:, Returns:, Raises:, Attributes:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The tables of contents list pages and their sections, not every documented object: Sphinx's
# default put each class, function and constant (UPSTREAM_RETRY_MAX_S) in the index's toctree.
toc_object_entries = False
# Code samples in docstrings use ``double backticks``; a single-backtick span is code too.
default_role = "code"


def _markdown_tables_as_literal(app, what, name, obj, options, lines: list[str]) -> None:
    """Shows a docstring's Markdown table (lines starting with ``|``, as the source reads
    best) as a literal block: reStructuredText would read ``|`` as a line block."""
    out: list[str] = []
    in_table = False
    for line in lines:
        is_row = line.lstrip().startswith("|")
        if is_row and not in_table:
            out += ["::", ""]
        elif not is_row and in_table:
            out.append("")
        in_table = is_row
        out.append("    " + line if is_row else line)
    lines[:] = out


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _markdown_tables_as_literal)
