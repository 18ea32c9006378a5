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


def test_record_at_or_after_walks_headers_to_the_first_boundary_past_a_point(tmp_path):
    from motor.execution.joblog import JobDirError, record_at_or_after

    path = tmp_path / "output.log"
    records = [encode_record(1 + i % 2, b"x" * (10 + i)) for i in range(20)]
    path.write_bytes(b"".join(records))
    starts = [sum(map(len, records[:i])) for i in range(len(records) + 1)]
    assert record_at_or_after(path, 0, 0) == 0
    assert record_at_or_after(path, 0, starts[5]) == starts[5]  # a boundary itself
    assert record_at_or_after(path, 0, starts[5] + 1) == starts[6]  # inside a record: the next
    assert record_at_or_after(path, starts[3], starts[7] - 2) == starts[7]  # from a boundary
    assert record_at_or_after(path, 0, starts[-1] + 100) == starts[-1]  # no whole record past it
    with open(path, "ab") as f:  # a partial header at the end: the log's end so far
        f.write(b"\x01\x00")
    assert record_at_or_after(path, 0, starts[-1] + 1) == starts[-1]
    path.write_bytes(records[0] + b"\x07" + b"\x00" * 20)  # a stream byte no keeper writes
    with pytest.raises(JobDirError):
        record_at_or_after(path, 0, len(records[0]) + 5)


def _blocks(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def _punches(directory: Path) -> bool:
    """Whether the file system under `directory` gives a punched range's blocks back."""
    from motor.execution import jobdir

    probe = directory / "punch-probe"
    with open(probe, "wb") as f:
        f.write(b"p" * (1 << 20))
        os.fsync(f.fileno())
    before = _blocks(probe)
    jobdir.punch(probe, 0, 1 << 20)
    try:
        return _blocks(probe) < before
    finally:
        probe.unlink()


def test_reads_past_16_mib_give_the_stored_part_of_the_log_back_to_the_file_system(tmp_path):
    """Each read from an offset past FREE_READ_AFTER_BYTES punches the two batches below
    it (the store has them): the log keeps its size and offsets, its blocks there go."""
    from motor.execution import core, jobdir

    path = tmp_path / "output.log"
    chunk = encode_record(1, b"y" * 65531)  # 64 KiB a record, as the keeper writes them
    path.write_bytes(chunk * 400)  # 25 MiB
    size, decoder, offset = path.stat().st_size, core.OutputDecoder(), 0
    if _blocks(path) < size:
        pytest.skip("the file system did not allocate the log whole")
    while offset < size:
        events, offset = jobdir.read_output(tmp_path, offset, core.READ_BATCH_BYTES, decoder)
        assert events and all(e.data == "y" * 65531 for e in events)
    assert path.stat().st_size == size  # offsets unchanged
    if not _punches(tmp_path):
        pytest.skip("the file system cannot punch holes (the runner logs it once)")
    # everything up to the last read's start, the log's first part too
    assert _blocks(path) <= size - offset + 2 * core.READ_BATCH_BYTES + 65536, _blocks(path)
    assert path.read_bytes()[:len(chunk)] == b"\0" * len(chunk)  # zeros, never read again


def test_more_than_the_output_cap_unread_is_skipped_to_its_last_cap_with_a_note(tmp_path):
    from motor.execution import core, jobdir

    path = tmp_path / "output.log"
    chunk = encode_record(1, b"z" * 65531)
    path.write_bytes(encode_record(2, b"first\n") + chunk * 400 + encode_record(1, b"last\n"))
    size, keep = path.stat().st_size, 2 * 1024 * 1024
    decoder = core.OutputDecoder(keep)
    events, offset = jobdir.read_output(tmp_path, 0, core.READ_BATCH_BYTES, decoder)
    assert events[0].data == "first\n"  # the batch read is kept...
    note = events[-1]
    assert note.stream == "stderr" and "bytes of output were skipped" in note.data
    assert size - keep <= offset <= size - keep + len(chunk)  # ...then on to the last `keep`
    skipped = int(note.data.split("motor: ")[1].split()[0])
    assert offset - skipped == sum(len(e.data) + 5 for e in events[:-1])  # records' bytes
    rest = []
    while offset < size:
        batch, offset = jobdir.read_output(tmp_path, offset, core.READ_BATCH_BYTES, decoder)
        rest += batch
    assert rest[-1].data == "last\n" and not any("skipped" in e.data for e in rest)
    if not _punches(tmp_path):
        pytest.skip("the file system cannot punch holes")
    assert _blocks(path) < size - skipped + len(chunk), _blocks(path)  # skipped: punched


def test_a_save_waiting_for_space_skips_the_unread_log_and_the_next_read_goes_on_after_it(
        tmp_path):
    """`jobdir.relieve`, as the job actor calls it while the store waits for space to save
    the batch ending at `offset`: past twice min(cap, 16 MiB) unread, the log is skipped to
    its last such part at once (punched), and the read from `offset` goes on there."""
    from motor.config import RunnerConfig
    from motor.execution import core, jobdir
    from motor.records import JobRecord

    path = tmp_path / "output.log"
    chunk = encode_record(1, b"w" * 65531)
    path.write_bytes(chunk * 100 + encode_record(1, b"last\n"))  # 6.3 MiB
    size = path.stat().st_size
    config = RunnerConfig(state_dir=str(tmp_path), max_output_bytes_per_job="1M")
    run = core.JobRun(JobRecord(job_id="j", state="running", command=["x"], workspace="w",
                                claim=1), False, config, tmp_path)
    offset = 10 * len(chunk)  # the batch being saved ends here
    jobdir.relieve(run, offset)
    start, skip_to = run.output.pending_skip
    assert start == offset and size - 1024 * 1024 <= skip_to <= size - 1024 * 1024 + len(chunk)
    assert (skip_to - offset) % len(chunk) == 0  # a record's start
    events, new = jobdir.read_output(tmp_path, offset, core.READ_BATCH_BYTES, run.output)
    assert new == skip_to and "bytes of output were skipped" in events[0].data
    assert run.output.pending_skip is None
    rest = []
    while new < size:
        batch, new = jobdir.read_output(tmp_path, new, core.READ_BATCH_BYTES, run.output)
        rest += batch
    assert rest[-1].data == "last\n"
    relieved = core.JobRun(run.record, False, config, tmp_path)
    jobdir.relieve(relieved, size - 2 * 1024 * 1024)  # not past twice the part kept: nothing
    assert relieved.output.pending_skip is None
