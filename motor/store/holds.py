"""The store's writes held for a WAL checkpoint, and for how long at most.

The store actor holds its writes (saves wait in its inbox, the event loop runs on) while a
checkpoint round's second step runs, or while the WAL file is past its bound
(motor/store/checkpoints.py). A hold never lasts longer than HOLD_MAX_S: callers wait for
their saves with a timeout (30 s), and a disk whose syncs stall must not make them time
out. A hold that ran that long lets the writes go on and no new one starts until the round
ends (the WAL then starts over at a later round).
"""

from __future__ import annotations

import time

import trio

__all__ = ["HOLD_MAX_S", "WriteHold"]

#: the longest the writes are held at a time
HOLD_MAX_S = 0.5


class WriteHold:
    """Whether the writes are held (`event`: what they wait for), and for how long."""

    def __init__(self) -> None:
        self.event: trio.Event | None = None
        self._since = 0.0
        self._held_s = 0.0  # in the round so far
        self._spent = False  # a hold of this round ran out: no other until it ends

    def hold(self, nursery: trio.Nursery) -> None:
        """Hold the writes (no-op if they are, or a hold of this round ran out)."""
        if self.event is None and not self._spent:
            self.event, self._since = trio.Event(), time.perf_counter()
            nursery.start_soon(self._expire, self.event)

    async def _expire(self, event: trio.Event) -> None:
        await trio.sleep(HOLD_MAX_S)
        if self.event is event:
            self._spent = True
            self.release()

    def release(self) -> None:
        if self.event is not None:
            event, self.event = self.event, None
            event.set()
            self._held_s += time.perf_counter() - self._since

    def round_ended(self) -> float:
        """Release the writes; how long they were held in the round that ended."""
        self.release()
        held, self._held_s, self._spent = self._held_s, 0.0, False
        return held
