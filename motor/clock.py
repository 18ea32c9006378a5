"""Wall-clock time, behind one replaceable object.

Durations inside the runner come from trio's clock; wall-clock milliseconds (UUIDv7 ids,
record timestamps, retention, hourly buckets) come from a `WallClock`, which tests replace
with `MockWallClock` tied to trio's MockClock so a day of retention passes in milliseconds.
"""

from __future__ import annotations

import os
import time
import uuid


class WallClock:
    """Real time: milliseconds since the Unix epoch."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class MockWallClock(WallClock):
    """Wall time = a fixed epoch plus trio's current (possibly mock) time."""

    def __init__(self, epoch_ms: int = 1_790_000_000_000):
        self.epoch_ms = epoch_ms

    def now_ms(self) -> int:
        import trio

        return self.epoch_ms + int(trio.current_time() * 1000)


_last = [0, 0]  # [ms, counter] keeps ids from one process strictly increasing


def uuid7(now_ms: int) -> str:
    """A UUIDv7 (RFC 9562) string whose time field is `now_ms`; monotonic within a process."""
    ms, counter = _last
    if now_ms <= ms:
        now_ms, counter = ms, counter + 1
    else:
        counter = int.from_bytes(os.urandom(2), "big") & 0x3FF
    _last[0], _last[1] = now_ms, counter
    rand_a = counter & 0xFFF
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (now_ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return str(uuid.UUID(int=value))


def uuid7_ms(job_id: str) -> int:
    """The millisecond time field of a UUIDv7 string (0 if it is not one)."""
    try:
        value = uuid.UUID(job_id).int
    except ValueError:
        return 0
    return value >> 80
