"""Small files read whole in four system calls (open, read, read at the end, close).

`open(path, "rb").read()` makes nine (fstat twice, an isatty ioctl, lseek twice) and the
text wrapper of `open(path)` costs more: keeperd and the runner read spec.json, status.json,
cgroup knobs and /proc lists once or more per job (issue 14). Standard library only, so
that keeperd and the isolation backends can use it.

`read_named` reads a file an operator names (the config, the token file, the capacity
file): such a path can name a FIFO or a device by mistake, and an `open` of a FIFO waits
for a writer for ever (inside the runner a signal's retry of it too, so SIGTERM was lost:
stop 67). It opens without waiting, reads only a regular file, and at most `NAMED_LIMIT`
bytes.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NAMED_LIMIT", "read_bytes", "read_named"]

#: the most `read_named` reads: operators' files are a few lines
NAMED_LIMIT = 1 << 20


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, read to its end (also a /proc file, whose stat says 0 bytes)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_named(path: str | os.PathLike[str], limit: int = NAMED_LIMIT) -> bytes:
    """A regular file's bytes, never waiting on a FIFO or a device; OSError (its `strerror`
    says why) when `path` names something else or holds more than `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    finally:
        os.close(fd)
    return b"".join(chunks)
