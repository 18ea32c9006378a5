"""Reading the memory ceiling from the host: the capacity file and the jobs group limit."""

from __future__ import annotations

import logging
from typing import Callable

from ..isolation.base import IsolationError
from ..smallfiles import read_named
from .core import CapacityFileError, MemoryCeiling, parse_capacity_file

log = logging.getLogger("motor.memory")


def _undeclared(path: str, why: str) -> None:
    log.warning("capacity file %s unreadable (%s); treating jobs_min_bytes as undeclared",
                path, why)
    return None


def read_declared_min(path: str) -> int | None:
    """The declared jobs_min_bytes; None when the file is absent or undeclared.

    An unreadable or malformed file is logged and treated as undeclared (the safe default:
    jobs keep running with limits clamped to the jobs group), never a crash.
    """
    try:
        text = read_named(path).decode()  # (a FIFO there: unreadable, not a wait for ever)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _undeclared(path, exc.strerror or str(exc))
    except UnicodeDecodeError:
        return _undeclared(path, "not UTF-8 text")
    try:
        return parse_capacity_file(text, path)
    except CapacityFileError as exc:
        log.warning("%s; treating jobs_min_bytes as undeclared", exc)
        return None


def read_ceiling(capacity_file: str, slice_limit: Callable[[], int | None],
                 previous: MemoryCeiling | None = None) -> MemoryCeiling:
    """The ceiling now. A jobs group limit that cannot be read (a file error, systemd not
    answering) keeps the previous reading, or counts as unlimited at start-up: logged,
    never raised."""
    try:
        slice_max = slice_limit()
    except (OSError, IsolationError) as exc:
        if previous is not None:
            log.warning("cannot read the jobs group's memory limit (%s); keeping %s", exc,
                        previous.slice_max_bytes)
            slice_max = previous.slice_max_bytes
        else:
            log.warning("cannot read the jobs group's memory limit (%s); treating it as "
                        "unlimited", exc)
            slice_max = None
    return MemoryCeiling(declared_min_bytes=read_declared_min(capacity_file),
                         slice_max_bytes=slice_max, capacity_file=capacity_file)
