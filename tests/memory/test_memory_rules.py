"""Memory and the jobs slice (scheduling.md): the pure rules."""

from __future__ import annotations

import pytest

from motor.memory.core import (
    FLOOR_BYTES, CapacityFileError, MemoryCeiling, admission, parse_capacity_file, unit_limit,
)

GiB = 1024**3


def test_the_unit_limit_is_clamped_to_the_slice_and_never_above_it():
    ceiling = MemoryCeiling(slice_max_bytes=24 * GiB)
    assert unit_limit(32 * GiB, ceiling) == 24 * GiB  # a big claim: clamped to the slice
    assert unit_limit(8 * GiB, ceiling) == 8 * GiB  # below the slice: its own memory_max
    assert unit_limit(24 * GiB, ceiling) == 24 * GiB
    for memory_max in (1, 16 * GiB, 10**15):
        assert unit_limit(memory_max, ceiling) <= ceiling.slice_max_bytes
    assert unit_limit(32 * GiB, MemoryCeiling()) == 32 * GiB  # no slice limit: nothing to clamp


def test_an_undeclared_boat_sized_slice_admits_eight_vcpus_and_clamps_the_unit_limit():
    boat = MemoryCeiling(declared_min_bytes=None, slice_max_bytes=12 * GiB)
    assert admission(boat) is None  # undeclared: admitted even below 16 GiB
    eight_vcpus = 8 * 4 * GiB
    assert unit_limit(eight_vcpus, boat) == 12 * GiB


def test_admission_refuses_before_start_when_the_declared_minimum_is_below_the_floor():
    refusal = admission(MemoryCeiling(declared_min_bytes=8 * GiB, slice_max_bytes=64 * GiB,
                                      capacity_file="/etc/motor-host/capacity.json"))
    assert refusal is not None
    assert refusal.code == "workspace_setup_failed"
    assert str(8 * GiB) in refusal.detail and str(FLOOR_BYTES) in refusal.detail
    assert "repair" in refusal.detail and "jobs_min_bytes" in refusal.detail
    # a declared minimum that covers the floor, but a live slice below it: refused too
    slice_short = admission(MemoryCeiling(declared_min_bytes=32 * GiB, slice_max_bytes=8 * GiB))
    assert slice_short is not None and "memory limit" in slice_short.detail


def test_admission_accepts_when_the_declared_minimum_and_slice_cover_the_floor():
    assert admission(MemoryCeiling(declared_min_bytes=16 * GiB, slice_max_bytes=16 * GiB)) is None
    assert admission(MemoryCeiling(declared_min_bytes=64 * GiB, slice_max_bytes=None)) is None


@pytest.mark.parametrize("text", ["{", "[]", '{"jobs_min_bytes": "lots"}',
                                  '{"jobs_min_bytes": -1}', '{"jobs_min_bytes": true}'])
def test_a_malformed_capacity_file_is_a_clear_error(text):
    with pytest.raises(CapacityFileError, match="capacity.json"):
        parse_capacity_file(text, "capacity.json")


def test_capacity_file_without_a_declaration_is_undeclared():
    assert parse_capacity_file('{"other": 1}') is None
    assert parse_capacity_file('{"jobs_min_bytes": 17179869184}') == 16 * GiB


def test_an_unreadable_slice_limit_keeps_the_last_reading_and_never_raises(tmp_path, caplog):
    from motor.isolation import IsolationError
    from motor.memory.host import read_ceiling

    GiB = 1 << 30
    capacity = str(tmp_path / "capacity.json")  # absent: undeclared
    first = read_ceiling(capacity, lambda: 64 * GiB)
    assert first.slice_max_bytes == 64 * GiB

    def unreachable():
        raise IsolationError("systemd: call on /run/systemd/private failed: timed out")

    kept = read_ceiling(capacity, unreachable, first)  # a maintenance pass
    assert kept.slice_max_bytes == 64 * GiB
    assert "keeping" in caplog.text and "timed out" in caplog.text
    assert read_ceiling(capacity, unreachable).slice_max_bytes is None  # start-up: unlimited

    def unreadable():
        raise PermissionError(13, "Permission denied")

    assert read_ceiling(capacity, unreadable, first).slice_max_bytes == 64 * GiB
