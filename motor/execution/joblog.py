"""On-disk job directory format shared by the keeper and the runner.

Stdlib only: this module is imported by the forkserver/keeper process, which
must stay small (see docs/keeper.md).

Job directory ``<state>/jobs/<job_id>/``:

- ``spec.json``    written by the runner (atomically) before spawning
- ``keeper.json``  the claim: written by the forkserver before the keeper may start
                   anything (exclusive link), completed by the keeper with the job's pid
- ``output.log``   append-only framed records: ``<BI`` (stream, length) + data
- ``status.json``  written by the keeper after the job exited and output drained
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from ..smallfiles import read_bytes

__all__ = [
    "KEEPER_FILE",
    "OUTPUT_FILE",
    "RECORD_HEADER",
    "SPEC_FILE",
    "STATUS_FILE",
    "STDERR",
    "STDOUT",
    "STREAM_NAMES",
    "MAX_RECORD_BYTES",
    "READ_MAX_BYTES",
    "JobDirError",
    "encode_record",
    "read_json",
    "read_keeper",
    "read_records",
    "read_spec",
    "read_status",
    "write_bytes_atomic",
    "write_json_atomic",
]

SPEC_FILE = "spec.json"
KEEPER_FILE = "keeper.json"
OUTPUT_FILE = "output.log"
STATUS_FILE = "status.json"

STDOUT = 1
STDERR = 2
STREAM_NAMES = {STDOUT: "stdout", STDERR: "stderr"}

#: Record header: stream byte (1=stdout, 2=stderr) and payload length.
RECORD_HEADER = struct.Struct("<BI")

#: How much of ``output.log`` one ``read_records`` call reads by default: the runner turns
#: a log of any size into events batch by batch, so its memory does not grow with the log.
READ_MAX_BYTES = 1024 * 1024

#: The keeper writes records of at most 64 KiB (one pipe read); a header announcing more
#: than this is corrupt, and is refused rather than allocated.
MAX_RECORD_BYTES = 16 * 1024 * 1024


class JobDirError(Exception):
    """A job directory file exists but is corrupt or unreadable."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = Path(path)
        super().__init__(f"{self.path}: {message}")


def encode_record(stream: int, data: bytes) -> bytes:
    """One framed ``output.log`` record (header + data)."""
    return RECORD_HEADER.pack(stream, len(data)) + data


def read_records(
    path: str | os.PathLike[str], offset: int = 0, max_bytes: int = READ_MAX_BYTES
) -> tuple[list[tuple[str, bytes]], int]:
    """Complete records of ``output.log`` from byte ``offset``, at most ``max_bytes`` of it.

    Returns ``([(stream_name, data), ...], new_offset)``.  A partially written
    trailing record is not returned; ``new_offset`` points at its start so the
    next call picks it up once complete.  A missing file reads as empty.  At most
    ``max_bytes`` of the file are read per call (call again from ``new_offset`` for
    more), except that a first record larger than ``max_bytes`` is returned whole so
    a reader always makes progress.  A header announcing more than ``MAX_RECORD_BYTES``
    or a stream byte other than 1 or 2 raises ``JobDirError``.
    """
    hsize = RECORD_HEADER.size
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            buf = f.read(max(max_bytes, hsize))
            if len(buf) >= hsize:
                length = _check_header(path, buf, 0, offset)[1]
                if hsize + length > len(buf) == max(max_bytes, hsize):
                    # the first record alone is larger than a batch: read just that record
                    buf += f.read(hsize + length - len(buf))
    except FileNotFoundError:
        return [], offset
    records: list[tuple[str, bytes]] = []
    pos = 0
    end = len(buf)
    while end - pos >= hsize:
        name, length = _check_header(path, buf, pos, offset)
        if end - pos - hsize < length:
            break
        start = pos + hsize
        records.append((name, buf[start : start + length]))
        pos = start + length
    return records, offset + pos


def record_at_or_after(path: str | os.PathLike[str], offset: int, target: int) -> int:
    """The offset of the first record of the log that starts at or after `target`, walking
    the records' headers from `offset` (a record boundary); the log's end, where it has
    no whole record so far (JobDirError for a header no keeper writes)."""
    pos = offset
    with open(path, "rb") as f:
        while pos < target:
            f.seek(pos)
            head = f.read(RECORD_HEADER.size)
            if len(head) < RECORD_HEADER.size:
                break
            pos += RECORD_HEADER.size + _check_header(path, head, 0, pos)[1]
    return pos


def _check_header(path, buf: bytes, pos: int, offset: int) -> tuple[str, int]:
    stream, length = RECORD_HEADER.unpack_from(buf, pos)
    name = STREAM_NAMES.get(stream)
    if name is None:
        raise JobDirError(path, f"bad record stream byte {stream} at offset {offset + pos}")
    if length > MAX_RECORD_BYTES:
        raise JobDirError(path, f"record length {length} at offset {offset + pos} is above "
                                f"the {MAX_RECORD_BYTES}-byte limit (corrupt log)")
    return name, length


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, fsync: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` via a temp file + rename.

    Readers see either the old file, no file, or the complete new file.
    ``fsync=True`` also flushes the data to disk before the rename.
    """
    write_bytes_atomic(path, json.dumps(obj, separators=(",", ":")).encode(), fsync=fsync)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> None:
    """`write_json_atomic` for JSON already encoded (the runner's msgspec encoder: spec.json)."""
    path = os.fspath(path)
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # may hold env
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Parse a JSON object file; None if absent, JobDirError if corrupt."""
    try:
        data = read_bytes(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JobDirError(path, f"unreadable: {exc}") from exc
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise JobDirError(path, f"corrupt JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise JobDirError(path, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_spec(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    return read_json(os.path.join(job_dir, SPEC_FILE))


def read_keeper(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    return read_json(os.path.join(job_dir, KEEPER_FILE))


def read_status(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    return read_json(os.path.join(job_dir, STATUS_FILE))
