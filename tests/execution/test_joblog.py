from __future__ import annotations

import os

import pytest

from motor.execution import (
    JobDirError,
    read_keeper,
    read_records,
    read_status,
    write_json_atomic,
)
from motor.execution.joblog import RECORD_HEADER, encode_record


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
