"""Unit tests of ``fedgrid.capabilities``: sizes as people write them and the bounds on what a client reports."""

from __future__ import annotations

import pytest

from fedgrid.capabilities import (
    MAX_ACCELERATORS,
    MAX_MEMORY_BYTES,
    Capabilities,
    CapabilityOverride,
    check_capabilities,
    describe,
    format_size,
    parse_size,
)
from fedgrid.errors import InvalidUpdateError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("17179869184", 17179869184),
        ("16GiB", 16 << 30),
        ("16gib", 16 << 30),
        ("512MB", 512_000_000),
        ("1.5G", 1_500_000_000),
        (" 2 TiB ", 2 << 40),
        ("64k", 64_000),
        ("3B", 3),
        ("1PiB", MAX_MEMORY_BYTES),
    ],
)
def test_sizes_parse_to_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("lots", "min_client_memory: 'lots' is not a size"),
        ("-1GiB", "is not a size"),
        ("16 GiBs", "is not a size"),
        ("", "is not a size"),
        ("2PiB", "min_client_memory: '2PiB' is over the most a client may report, 1.0 PiB"),
    ],
)
def test_bad_sizes_name_the_key(text, message):
    with pytest.raises(ValueError) as info:
        parse_size(text, what="min_client_memory")
    assert message in str(info.value)


def test_a_report_in_a_few_characters():
    assert [describe("cuda", 2, 80 << 30), describe("cpu", 0, 16 << 30), describe("cpu", 0, 0)] == [
        "cuda x2, 80.0 GiB memory",
        "cpu, 16.0 GiB memory",
        "cpu",
    ]


def test_format_size_picks_the_largest_binary_unit():
    assert [format_size(n) for n in (0, 1023, 1024, 16 << 30, (3 << 40) + (1 << 39), MAX_MEMORY_BYTES)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "16.0 GiB",
        "3.5 TiB",
        "1.0 PiB",
    ]


@pytest.mark.parametrize(
    "device, accelerators, memory, message",
    [
        ("CUDA", 0, 0, "device: 'CUDA' is not a device type"),
        ("cuda\n[FAKE] joined", 0, 0, "device: 'cuda\\n[FAKE] joined' is not a device type"),
        ("", 0, 0, "device: '' is not a device type"),
        ("x" * 33, 0, 0, "at most 32 characters"),
        ("cuda", MAX_ACCELERATORS + 1, 0, "num_accelerators: 1025 reported, must be in 0..1024"),
        ("cuda", -1, 0, "num_accelerators: -1 reported"),
        (
            "cpu",
            0,
            MAX_MEMORY_BYTES + 1,
            f"memory_bytes: {MAX_MEMORY_BYTES + 1} reported, must be in 0..{MAX_MEMORY_BYTES} (1 PiB)",
        ),
        ("cpu", 0, -5, "memory_bytes: -5 reported"),
    ],
)
def test_out_of_bounds_reports_are_refused_naming_the_field(device, accelerators, memory, message):
    with pytest.raises(InvalidUpdateError) as info:
        check_capabilities(device, accelerators, memory)
    assert message in str(info.value)
    with pytest.raises(ValueError, match="device|num_accelerators|memory_bytes"):
        Capabilities(device, accelerators, memory)  # a client finds out before its Join is refused


def test_in_bounds_reports_pass():
    for device in ("cpu", "cuda", "mps", "xpu", "privateuseone"):
        check_capabilities(device, MAX_ACCELERATORS, MAX_MEMORY_BYTES)


def test_an_override_replaces_only_the_fields_it_states():
    detected = Capabilities("cpu", 0, 64 << 30)
    assert CapabilityOverride().apply(detected) == detected
    assert CapabilityOverride(memory_bytes=8 << 30).apply(detected) == Capabilities("cpu", 0, 8 << 30)
    assert CapabilityOverride(device="cuda", num_accelerators=0, memory_bytes=0).apply(
        detected
    ) == Capabilities("cuda", 0, 0)
    with pytest.raises(ValueError, match="num_accelerators: 5000"):
        CapabilityOverride(num_accelerators=5000).apply(detected)
