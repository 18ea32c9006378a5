"""The build-folder guard after jobs' ends, its walk off the disk actor's turn.

A job's end (`JobIdle`) makes its workspace due for the guard (`GuardDue`, GUARD_DELAY_S
later, once for every workspace jobs left meanwhile). The guard walks those workspaces
(their sizes), then applies the cap (docs/disk.md, "The build-folder cap"). The walk runs in
a worker thread while the disk actor goes on answering: admissions and job set-ups do not
wait behind it (stop 60: each job end in a workspace of 300,000 files held every other
admission about 0.6 s; a walk that hangs on a file system that stopped answering held them
for good). The decision comes back to the actor as a message (`GuardWalked`), on what live
jobs hold then (`Trees.guard_finish`). One such walk at a time: workspaces due meanwhile
wait for it.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from . import host
from .messages import GuardDue, GuardWalked

__all__ = ["GuardTurns", "WALK_STALLED_S"]

#: a guard walk running this long is said in health (a file system that stopped answering?)
WALK_STALLED_S = 60.0


class GuardTurns:
    """The disk actor's guard: `ended` arms it for a job's workspace, `due` (the actor's
    `GuardDue`) starts a walk (or queues the names behind the one in flight), `walked`
    decides on its survey inside the actor's turn."""

    def __init__(self, trees: Any, start_soon: Callable, tell: Callable) -> None:
        self.trees, self.start_soon, self.tell = trees, start_soon, tell
        self.armed: set[str] | None = None  # job ends' workspaces, GuardDue on its way
        self.walking = False
        self.walk_began: tuple[float, list[str]] | None = None  # when, which: `stalled`
        self.next: set[str] = set()  # due while a walk ran

    def ended(self, workspace: str) -> None:
        """A job left `workspace`: guard it GUARD_DELAY_S from the first such end."""
        if self.armed is None:
            self.armed = set()
            self.start_soon(self._arm)
        self.armed.add(workspace)

    async def _arm(self) -> None:
        await trio.sleep(host.GUARD_DELAY_S)
        await self.tell(GuardDue())

    def due(self, live_view: Callable, names: set[str] | None = None) -> list[str]:
        """Start the guard of `names` (None: those armed; none is dropped here: the
        decision comes after)."""
        if names is None:
            names, self.armed = self.armed or set(), None
        if self.walking:
            self.next |= names
            return []
        looked, wanted = self.trees.guard_survey(live_view, names)
        if looked:
            self.walking = True
            self.start_soon(self._walk, looked, wanted)
        return []

    async def _walk(self, looked: list, wanted: set[str]) -> None:
        trees = self.trees
        self.walk_began = (trio.current_time(), sorted(wanted))
        try:
            found = await trees.offload(host.survey, looked, None, wanted, trees.clock.now_ms())
        except BaseException:
            self.walking = False
            trees.sizes.dirty.update(wanted)  # measured again when next wanted
            raise
        finally:
            self.walk_began = None
        await self.tell(GuardWalked(looked, found))

    def stalled(self, now: float) -> str | None:
        """A health problem while a guard walk has run WALK_STALLED_S or more."""
        if self.walk_began is None or now - self.walk_began[0] < WALK_STALLED_S:
            return None
        began, names = self.walk_began
        return (f"the build-folder guard's walk of {', '.join(names) or 'its workspaces'} has "
                f"run {now - began:.0f} s (a file system that does not answer?); jobs are "
                "admitted and started meanwhile, the cap waits for it")

    async def now(self, live_view: Callable, cap_bytes: int, names=None) -> list[str]:
        """The guard in the caller's turn (a maintenance pass; a `JobIdle` call): the names
        dropped. While a walk runs off the turn, the names wait for it instead (walked twice
        at once, the older walk could land last)."""
        if self.walking:
            pending = self.trees.sizes.guard_pending
            self.next |= set(pending if names is None else pending.intersection(names))
            return []
        return await self.trees.guard(live_view, cap_bytes, names)

    async def walked(self, msg: GuardWalked, live_view: Callable, cap_bytes: int) -> list[str]:
        """The walk is done: the cap applied on it; then the names due meanwhile."""
        self.walking = False
        dropped = await self.trees.guard_finish(live_view, cap_bytes, msg.looked, msg.found)
        if self.next:
            names, self.next = self.next, set()
            self.due(live_view, names)
        return dropped
