"""glibc allocator settings of the coordinator and of the batched simulation engine."""

from __future__ import annotations

import ctypes.util
import platform

from fedgrid.allocator import keep_large_buffers, return_large_buffers_to_the_system

GLIBC = (
    platform.system() == "Linux"
    and platform.libc_ver()[0] == "glibc"
    and ctypes.util.find_library("c") is not None
)


def test_mallopt_settings_apply_on_glibc():
    # The coordinator's setting and the simulation's are both accepted by glibc's mallopt
    # (it returns 0 for an unknown parameter or a value out of range).
    assert keep_large_buffers() is GLIBC
    assert return_large_buffers_to_the_system() is GLIBC
