"""Unit tests of ``fedgrid.client.capabilities``: what a client detects and reports at Join."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from fedgrid.capabilities import Capabilities, CapabilityOverride
from fedgrid.client import Client, FitOutput
from fedgrid.client import capabilities as caps
from fedgrid.config import load_config

PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Plain(Client):
    def fit(self, state, ins):
        return FitOutput(state, num_examples=0)


def test_host_memory_is_the_physical_memory_without_a_cgroup_limit(tmp_path):
    assert caps.host_memory_bytes(limit_files=()) == PHYSICAL > 0
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2: no limit
    assert caps.host_memory_bytes(limit_files=(str(tmp_path / "memory.max"),)) == PHYSICAL


def test_host_memory_is_the_container_limit_when_smaller(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text(f"{1 << 30}\n")
    v1.write_text(f"{2 << 30}\n")
    assert caps.host_memory_bytes(limit_files=(str(tmp_path / "absent"), str(v2), str(v1))) == 1 << 30
    assert caps.host_memory_bytes(limit_files=(str(v1),)) == 2 << 30
    v1.write_text(f"{PHYSICAL * 4}\n")  # cgroup v1's "no limit" is a huge number: the host's memory stands
    assert caps.host_memory_bytes(limit_files=(str(v1),)) == PHYSICAL


def test_a_cpu_client_reports_the_host_memory_and_no_accelerator(monkeypatch):
    monkeypatch.setattr(caps, "host_memory_bytes", lambda: 12 << 30)
    assert caps.detect_capabilities(None) == Capabilities("cpu", 0, 12 << 30)
    assert caps.detect_capabilities(torch.device("cpu")) == Capabilities("cpu", 0, 12 << 30)
    assert caps.detect_capabilities("meta") == Capabilities("meta", 0, 12 << 30)


@pytest.fixture
def two_gpus(monkeypatch):
    """A host with two visible GPUs of 80 GiB and 40 GiB (torch.cuda faked: the test runs on CPU)."""
    memory = [80 << 30, 40 << 30]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(memory))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=memory[i])
    )


def test_a_cuda_client_reports_its_gpus_and_the_training_gpus_memory(two_gpus):
    assert caps.detect_capabilities("cuda:0") == Capabilities("cuda", 2, 80 << 30)
    assert caps.detect_capabilities(torch.device("cuda", 1)) == Capabilities("cuda", 2, 40 << 30)
    assert caps.detect_capabilities("cuda") == Capabilities("cuda", 2, 40 << 30)  # no index: the smallest GPU


def test_a_broken_cuda_driver_reports_zeros_instead_of_failing(monkeypatch):
    def broken():
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert caps.detect_capabilities("cuda") == Capabilities("cuda", 0, 0)


def test_client_capabilities_detect_on_its_device_then_apply_the_override(two_gpus, monkeypatch):
    monkeypatch.setattr(caps, "host_memory_bytes", lambda: 12 << 30)
    plain = Plain()
    assert plain.capabilities() == Capabilities("cpu", 0, 12 << 30)  # no device attribute: the CPU
    plain.device = torch.device("cuda", 0)  # type: ignore[attr-defined]  # as a TorchClient has
    assert plain.capabilities() == Capabilities("cuda", 2, 80 << 30)
    plain.capability_override = CapabilityOverride(num_accelerators=1, memory_bytes=70 << 30)
    assert plain.capabilities() == Capabilities("cuda", 1, 70 << 30)
    assert Plain().capability_override == CapabilityOverride()  # the class default is not shared state


def test_a_torch_client_reports_its_training_device(monkeypatch):
    from fedgrid.simulation import tasks

    monkeypatch.setattr(caps, "host_memory_bytes", lambda: 3 << 30)
    assert tasks.builtin_client(
        0, 3, seed=0, options=tasks.ClientOptions(device="cpu")
    ).capabilities() == Capabilities("cpu", 0, 3 << 30)


def test_the_report_keys_become_an_override():
    assert caps.override_from(load_config()) == CapabilityOverride()
    config = load_config(
        overrides={"report_device": "cuda", "report_accelerators": 4, "report_memory": "24GiB"}
    )
    assert caps.override_from(config) == CapabilityOverride("cuda", 4, 24 << 30)
    assert caps.override_from(load_config(overrides={"report_accelerators": 0})) == CapabilityOverride(
        num_accelerators=0
    )
