"""Small files read whole in four system calls (open, read, read at the end, close).

`open(path, "rb").read()` makes nine (fstat twice, an isatty ioctl, lseek twice) and the
text wrapper of `open(path)` costs more: keeperd and the runner read spec.json, status.json,
cgroup knobs and /proc lists once or more per job (issue 14). Standard library only, so
that keeperd and the isolation backends can use it.
"""

from __future__ import annotations

import os

__all__ = ["read_bytes"]


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
