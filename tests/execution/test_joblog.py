from __future__ import annotations

import os
from pathlib import Path

import pytest

from motor.execution import (
    JobDirError,
    read_keeper,
    read_records,
    read_status,
    write_json_atomic,
)
from motor.execution.joblog import RECORD_HEADER, encode_record, read_spec
from motor.smallfiles import read_bytes


def test_read_records_incremental_and_partial(tmp_path):
    log = tmp_path / "output.log"
    assert read_records(log, 0) == ([], 0)  # absent: empty
    first = encode_record(1, b"hello\n") + encode_record(2, b"oops\n")
    third = encode_record(1, b"x" * 100)
    log.write_bytes(first + third[:3])  # partial header
    recs, off = read_records(log, 0)
    assert recs == [("stdout", b"hello\n"), ("stderr", b"oops\n")]
    assert off == len(first)
    with open(log, "ab") as f:
        f.write(third[3:50])  # header complete, data partial
    assert read_records(log, off) == ([], off)
    with open(log, "ab") as f:
        f.write(third[50:] + encode_record(2, b""))
    recs, off2 = read_records(log, off)
    assert recs == [("stdout", b"x" * 100), ("stderr", b"")]
    assert off2 == log.stat().st_size


def test_read_records_bad_stream(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(RECORD_HEADER.pack(9, 1) + b"z")
    with pytest.raises(JobDirError) as ei:
        read_records(log, 0)
    assert ei.value.path == log


def test_json_files(tmp_path):
    assert read_status(tmp_path) is None
    assert read_keeper(tmp_path) is None
    write_json_atomic(tmp_path / "status.json", {"exit_code": 0})
    assert read_status(tmp_path) == {"exit_code": 0}
    assert os.listdir(tmp_path) == ["status.json"]  # no temp files left behind
    (tmp_path / "keeper.json").write_text('{"keeper_pid": 1')  # truncated
    with pytest.raises(JobDirError) as ei:
        read_keeper(tmp_path)
    assert ei.value.path == tmp_path / "keeper.json"
    assert str(tmp_path / "keeper.json") in str(ei.value)
    (tmp_path / "status.json").write_text("[1]")
    with pytest.raises(JobDirError):
        read_status(tmp_path)


def test_read_bytes_reads_a_file_whole_whatever_its_size(tmp_path):
    """`read_bytes` (spec.json, status.json, /proc lists) reads to the end, past its chunk."""
    env = {f"VAR{i}": "x" * 100 for i in range(2000)}  # a 230 kB spec.json (a large env)
    write_json_atomic(tmp_path / "spec.json", {"command": ["true"], "env": env})
    assert read_spec(tmp_path) == {"command": ["true"], "env": env}
    assert read_bytes(tmp_path / "spec.json") == (tmp_path / "spec.json").read_bytes()
    (tmp_path / "empty").write_bytes(b"")
    assert read_bytes(tmp_path / "empty") == b""
    proc = f"/proc/{os.getpid()}/cmdline"  # size 0 in its stat: read to the end all the same
    assert read_bytes(proc) == Path(proc).read_bytes() and read_bytes(proc)
    with pytest.raises(FileNotFoundError):
        read_bytes(tmp_path / "absent")


def test_read_records_reads_at_most_max_bytes_per_call(tmp_path):
    """A large output.log is read in bounded batches, the offset advancing each time."""
    log = tmp_path / "output.log"
    records = [encode_record(1 + i % 2, bytes([65 + i % 26]) * 1000) for i in range(50)]
    log.write_bytes(b"".join(records))
    size = len(records[0])  # 1005 bytes each
    seen, offset, calls = [], 0, 0
    while True:
        recs, new = read_records(log, offset, max_bytes=4 * size + 10)
        if not recs:
            break
        calls += 1
        assert new - offset <= 4 * size + 10  # never more than asked for
        assert len(recs) == 4 or new == log.stat().st_size
        seen.extend(recs)
        offset = new
    assert offset == log.stat().st_size
    assert calls == 13
    assert seen == [("stdout" if i % 2 == 0 else "stderr", bytes([65 + i % 26]) * 1000)
                    for i in range(50)]


def test_read_records_returns_one_record_larger_than_max_bytes(tmp_path):
    """A single record above the batch size still makes progress (returned whole)."""
    log = tmp_path / "output.log"
    log.write_bytes(encode_record(1, b"a" * 5000) + encode_record(2, b"b"))
    recs, off = read_records(log, 0, max_bytes=100)
    assert recs == [("stdout", b"a" * 5000)] and off == 5005
    assert read_records(log, off, max_bytes=100) == ([("stderr", b"b")], log.stat().st_size)


def test_read_records_refuses_an_absurd_record_length(tmp_path):
    """A corrupt header cannot make the reader allocate gigabytes."""
    log = tmp_path / "output.log"
    log.write_bytes(RECORD_HEADER.pack(1, 2**31) + b"z" * 100)
    with pytest.raises(JobDirError, match="record length"):
        read_records(log, 0, max_bytes=1024)
