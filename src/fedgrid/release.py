"""fedgrid's release: the installed package's version (``fedgrid.__version__``), which a client
shows at Join and a coordinator of another release refuses (``errors.VersionMismatchError``).
Kernel-level so that the client and the server read it without importing the package's root."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["VERSION"]

try:
    VERSION = version("fedgrid")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0.0.0+unknown"
