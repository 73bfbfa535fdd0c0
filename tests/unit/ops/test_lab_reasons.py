"""What ``fedgrid.ops.lab`` says where no lab can be made (the lab itself: tests/sites/test_lab.py)."""

from __future__ import annotations

import pytest

from fedgrid.ops import lab


def test_without_root_the_lab_says_why_and_names_fedgrid_wan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab.sys, "platform", "linux")
    monkeypatch.setattr(lab.os, "geteuid", lambda: 1000)
    reason = lab.unavailable.__wrapped__()
    assert reason == (
        "the lab needs root (network namespaces, tc and iptables need CAP_NET_ADMIN); "
        "`fedgrid wan` emulates a link without it"
    )


def test_without_iptables_the_lab_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab.sys, "platform", "linux")
    monkeypatch.setattr(lab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab.shutil, "which", lambda tool: None if tool == "iptables" else f"/usr/sbin/{tool}")
    reason = lab.unavailable.__wrapped__()
    assert reason == "iptables not installed (Debian: apt-get install iproute2 iptables)"


def test_a_lab_where_none_can_be_made_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab, "unavailable", lambda: "the lab needs Linux network namespaces")
    with pytest.raises(
        lab.LabError, match="^no lab on this machine: the lab needs Linux network namespaces$"
    ):
        lab.Lab()
