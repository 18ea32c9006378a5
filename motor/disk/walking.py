"""The disk actor's walks of workspaces, off its turn.

A walk measures a workspace's sizes: one `lstat` per entry of its tree, as long as the tree
is big, and for good on a file system that stopped answering. Three things walk:

- the build-folder guard after jobs' ends: a job's end (`JobIdle`) makes its workspace due
  (`GuardDue`, GUARD_DELAY_S later, once for every workspace jobs left meanwhile); the cap
  is applied on the walk (docs/disk.md, "The build-folder cap");
- the maintenance pass (`Periodic`, every minute): the trash is emptied and every
  catalogued workspace is surveyed (gone ones forgotten, used ones walked) before the pass
  decides expiry, sweeps, the guard and retention on it;
- `motor workspaces` (`Listing`): the workspaces used since their last walk.

Each walk runs in a worker thread while the disk actor goes on answering: admissions and
job set-ups never wait behind it (stop 60: each job end in a workspace of 300,000 files
held every other admission about 0.6 s, and a walk that hangs held them for good while
health said `ok`; stop 61: the same for a maintenance pass and a listing). The survey comes
back to the actor as a message (`Walked`) and is decided on in its turn, on what live jobs
hold then (`Trees.keep_walk`: a walk is not kept for a workspace used meanwhile).

One walk at a time (two walks of one workspace at once, the older could land last).
Guards and maintenance passes due meanwhile wait for it (passes waiting together share one
walk and one summary); a listing does not wait: it answers from the sizes known, the ones
the walk in flight will update as they were before it.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from .. import faults
from . import host
from .messages import GuardDue, Walked

__all__ = ["Walks", "WALK_STALLED_S"]

#: a walk running this long is said in health (a file system that stopped answering?)
WALK_STALLED_S = 60.0

_WHAT = {"guard": "the build-folder guard's walk", "maintenance": "the maintenance pass's walk",
         "listing": "the walk for `motor workspaces`"}


class Walks:
    """The disk actor's walks: `ended` arms the guard for a job's workspace, `due` (the
    actor's `GuardDue`) starts its walk, `maintenance` and `listing` theirs, each with the
    deferred answer of its call; `walked` decides on a survey inside the actor's turn.
    `on_pass(survey, trash_left)`: the rest of a maintenance pass, in the actor's turn (its
    summary)."""

    def __init__(self, trees: Any, start_soon: Callable, tell: Callable,
                 on_pass: Callable, live_view: Callable) -> None:
        self.trees, self.start_soon, self.tell, self.on_pass = trees, start_soon, tell, on_pass
        self.live_view = live_view
        self.armed: set[str] | None = None  # job ends' workspaces, GuardDue on its way
        self.walking: str | None = None  # the kind of the walk in flight ("guard", ...)
        self.walk_began: tuple[float, str, list[str]] | None = None  # `stalled`
        self.next: set[str] = set()  # guards due while a walk ran
        self.passes: list = []  # maintenance passes' answers waiting for the walk in flight

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
            self._start("guard", looked, wanted)
        return []

    def maintenance(self, answer: Any) -> None:
        """A maintenance pass (`answer`: its call's deferred reply): its survey of every
        catalogued workspace now, or after the walk in flight."""
        self.passes.append(answer)
        self._next_pass()

    def _next_pass(self) -> None:
        """The passes waiting, served by one walk, unless a walk is in flight."""
        if self.passes and not self.walking:
            looked, answers, self.passes = self.trees.entries(), self.passes, []
            sweeps = self.trees.sweep_candidates(self.live_view(), looked,
                                                 self.trees.clock.now_ms())
            self._start("maintenance", looked, self.trees.begin_walk(looked), answers, sweeps)

    def listing(self, answer: Any, rows: Callable) -> None:
        """`motor workspaces` (`answer`: its call's deferred reply; `rows()` the listing
        from the sizes known): the workspaces used since their last walk are walked first,
        unless a walk is in flight (then, and with none used, it answers at once)."""
        looked = [] if self.walking else self.trees.entries(sorted(self.trees.sizes.dirty))
        if not looked:
            answer.reply(rows())
            return
        self._start("listing", looked, self.trees.begin_walk(looked), [answer])

    def _start(self, kind: str, looked: list, wanted: set[str], answers=(), sweeps=()) -> None:
        self.walking = kind
        self.start_soon(self._walk, kind, looked, wanted, list(answers), list(sweeps))

    async def _walk(self, kind: str, looked: list, wanted: set[str], answers: list,
                    sweeps: list) -> None:
        trees, now_ms = self.trees, self.trees.clock.now_ms()
        self.walk_began = (trio.current_time(), kind, sorted(wanted | {n for n, _ in sweeps}))
        try:
            if kind == "guard":
                await faults.ahit("disk.guard")  # tests: the guard's walk held
            trash_left = (await trees.offload(host.collect_trash, trees.names.allowed_roots)
                          if kind == "maintenance" else 0)
            scans = await trees.offload(host.stale_scans, sweeps, now_ms) if sweeps else {}
            found = await trees.offload(host.survey, looked, None, wanted, now_ms, scans)
        except BaseException:  # the actor ends: its callers get ActorDead
            self.walking = None
            trees.sizes.dirty.update(wanted)  # measured again when next wanted
            raise
        finally:
            self.walk_began = None
        await self.tell(Walked(kind, looked, found, answers, trash_left, scans))

    def stalled(self, now: float) -> str | None:
        """A health problem while a walk has run WALK_STALLED_S or more."""
        if self.walk_began is None or now - self.walk_began[0] < WALK_STALLED_S:
            return None
        began, kind, names = self.walk_began
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return (f"{_WHAT[kind]} of {', '.join(names[:5]) + more or 'its workspaces'} has run "
                f"{now - began:.0f} s (a file system that does not answer?); jobs are "
                "admitted and started meanwhile, what needs the walk waits for it")

    async def now(self, live_view: Callable, cap_bytes: int, names=None, *,
                  walk_later: bool = False) -> list[str]:
        """The guard in the caller's turn (a maintenance pass; a `JobIdle` call): the names
        dropped. While a walk runs off the turn, the names wait for it instead (walked twice
        at once, the older walk could land last). `walk_later` (a pass): those that need a
        walk first (used since their last: a job ended there during the pass's walk) are
        left to the guard's own walk, off the turn, right after the pass (stop 63)."""
        pending = self.trees.sizes.guard_pending
        todo = set(pending if names is None else pending.intersection(names))
        if self.walking:
            self.next |= todo
            return []
        if walk_later:
            later = self.trees.sizes.wanted(todo)
            self.next |= later
            todo -= later
        return await self.trees.guard(live_view, cap_bytes, todo) if todo else []

    async def walked(self, msg: Walked, live_view: Callable, cap_bytes: int, rows: Callable):
        """A walk is done: decided on in this turn (the guard's cap, the listing's rows,
        the rest of the maintenance passes); then what waited for it."""
        self.walking = None
        result: Any = None
        if msg.kind == "guard":
            result = await self.trees.guard_finish(live_view, cap_bytes, msg.looked, msg.found)
        elif msg.kind == "listing":
            self.trees.keep_walk(live_view(), msg.found)
            for answer in msg.answers:
                answer.reply(rows())
        else:
            summary = await self.on_pass(msg.found, msg.trash_left, msg.scans)
            for answer in msg.answers:
                answer.reply(summary)
        self._next_pass()
        if self.next and not self.walking:
            names, self.next = self.next, set()
            self.due(live_view, names)
        return result
