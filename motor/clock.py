"""Wall-clock time, behind one replaceable object.

Durations inside the runner come from trio's clock; wall-clock milliseconds (UUIDv7 ids,
record timestamps, retention, hourly buckets) come from a `WallClock`, which tests replace
with `MockWallClock` tied to trio's MockClock so a day of retention passes in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid


class WallClock:
    """Real time: milliseconds since the Unix epoch."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def guard_fail_after(self, seconds: float):
        """A guard in real seconds against a hung outside process (the forkserver):
        `trio.fail_after` under a real trio clock."""
        import trio

        return trio.fail_after(seconds)

    def guard_move_on_after(self, seconds: float):
        """Like `guard_fail_after`, but gives up quietly (`trio.move_on_after`)."""
        import trio

        return trio.move_on_after(seconds)

    async def offload(self, fn, *args):
        """Run short blocking host reads away from the event loop: a worker thread."""
        from .offload import thread_offload

        return await thread_offload(fn, *args)


class MockWallClock(WallClock):
    """Wall time = an epoch plus trio's current (possibly mock) time.

    The epoch defaults to the real time when the clock is made, so figures that real
    processes write with the real clock (a keeper's end time) line up with the runner's
    view at the start of a test; virtual time then runs ahead of them.
    """

    def __init__(self, epoch_ms: int | None = None):
        self.epoch_ms = time.time_ns() // 1_000_000 if epoch_ms is None else epoch_ms
        self._t0: float | None = None

    def now_ms(self) -> int:
        import trio

        now = trio.current_time()
        if self._t0 is None:  # trio's clock may not start at 0: count from first use
            self._t0 = now
        return self.epoch_ms + int((now - self._t0) * 1000)

    # Under trio's MockClock virtual time jumps while the runner waits on a real process, so
    # a virtual deadline would fire at once: the real-seconds guards are off (tests bound
    # their own run time); a zero timeout still means "do not wait".

    def guard_fail_after(self, seconds: float):
        return contextlib.nullcontext()

    async def offload(self, fn, *args):
        # inline: while a worker thread ran, virtual time would jump past every deadline
        return fn(*args)

    def guard_move_on_after(self, seconds: float):
        import trio

        return trio.move_on_after(seconds) if seconds <= 0 else contextlib.nullcontext()


_last = [0, 0]  # [ms, counter] keeps ids from one process strictly increasing


def uuid7(now_ms: int) -> str:
    """A UUIDv7 (RFC 9562) string whose time field is `now_ms`; monotonic within a process:
    at or before the last id's millisecond (a burst, or a wall clock stepped back) a 12-bit
    counter goes on from the last id's, and past its end the millisecond itself (RFC 9562,
    6.2; before stop 58 the counter wrapped after at most 4,096 ids, and the ids a runner
    made while its clock was stepped back stopped increasing)."""
    ms, counter = _last
    if now_ms <= ms:
        now_ms, counter = ms, counter + 1
        if counter > 0xFFF:
            now_ms, counter = ms + 1, 0
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
