"""Room on disk for a job: the disk actor's floor check and the cleanup that makes room
before it (its `Admit` and `PrepareSetup`, the periodic pass). A part of the actor's
shell, called only from its handlers, so the actor stays the one owner of the disk state;
the rules themselves are in core.py (`CleanupRun`, `admission`). docs/disk.md."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from actors import LATER

from .core import MAX_STEPS, STATE_FS, CleanupRun, DiskSample, admission
from .host import device

if TYPE_CHECKING:  # pragma: no cover
    from .actor import DiskActor


log = logging.getLogger("motor.disk")

#: how often the file systems the disk manager keeps room on are probed between admissions
#: and maintenance passes (a `statvfs` each)
PRESSURE_POLL_S = 2.0


#: below this much free after a cleanup, the state file system is full: the store's reserve
#: is given up (`Room._last_resort`)
FULL_BYTES = 1 << 20


class Room:
    def __init__(self, disk: "DiskActor"):
        self.disk = disk  # read at each use: its probe may be replaced (tests)
        self.unprobed: set[str] = set()  # roots whose probe failed, said once each
        self._state_dev: int | None = None  # the state dir's device, once read (`_state_device`)

    async def watch(self, make_room: Any) -> None:
        """Every PRESSURE_POLL_S, the floor check of the state dir's file system and of each
        workspace root's: when one is below its floor, `make_room` to the actor, which runs
        `make_room` (the cleanup a maintenance pass ends with) now, not at the next
        admission or maintenance pass. Before stop 55 a job that filled the disk left it
        full for up to a minute (the maintenance interval), its own status and output
        waiting for space."""
        while True:
            await trio.sleep(PRESSURE_POLL_S)
            if any(self._below(root) for root in self._roots()):
                await self.disk.cast_self(make_room)

    def _below(self, root: str) -> bool:
        try:
            return self._admission_now(root) is LATER
        except OSError:  # not there (removed, unmounted): `make_room` says so
            return False

    async def make_room(self) -> None:
        """The cleanup of each file system the disk manager keeps room on that needs one. A
        root that cannot be probed (removed, unmounted: a job's setup makes it again) is
        logged once and passed over; before stop 55 it crashed the disk actor at each
        maintenance pass."""
        for root in self._roots():
            try:
                sample = await self.cleanup(root, frozenset())
            except OSError as exc:
                if root not in self.unprobed:
                    log.warning("disk: %s cannot be probed (%s): no cleanup there until it "
                                "can", root, exc.strerror or exc)
                    self.unprobed.add(root)
            else:
                self.unprobed.discard(root)
                if root == str(self.disk.state_dir):
                    self._last_resort(sample)

    def _last_resort(self, sample: DiskSample) -> None:
        """The state file system still full after a cleanup that found nothing more to
        evict: the store's reserve goes (store/reserve.py), so that keeperd can write what
        it holds of a running job (its output, its status) and the store the job's end;
        the job's workspace, idle then, is what the next cleanup frees. Before stop 58 a
        job that filled the disk from its own workspace while keeperd held its output (no
        write of the store's to spend the reserve) waited for good."""
        reserve = self.disk.reserve
        if reserve is not None and reserve.held and sample.free_bytes < FULL_BYTES:
            reserve.release()

    def _roots(self) -> set[str]:
        d = self.disk
        return {str(d.state_dir), *d.names.allowed_roots}

    async def cleanup(self, where: str, incoming: frozenset[str]) -> DiskSample:
        """Plan, carry out the first action, probe again for real, re-plan; until done. On
        the state dir's file system the ended jobs' directories are emptied first (their
        output is in the store: a copy, however recent the end)."""
        d = self.disk
        sample = d.probe(Path(where))
        dev, run = device(where), CleanupRun(*self.floors(where, sample))
        copies = d.ended_dirs if where == str(d.state_dir) else None
        for step in range(MAX_STEPS):
            if step:
                sample = d.probe(Path(where))
            if not run.needed(sample):
                return sample
            if copies is not None:
                copies, emptied = None, await d.offload(copies.empty_ended, d.clock.now_ms(), 0)
                if emptied:
                    log.info("disk: the directories of %d ended jobs emptied to make room", emptied)
                    continue
            wss, staging, cache = await d.trees.candidates(d._live(), dev, d.compile_cache)
            action = run.next_action(wss, staging, cache, sample, d.clock.now_ms(),
                                     d.names.allowed_roots, incoming)
            if action is None:
                return sample
            run.done(action, await d.trees.execute(action))
        return d.probe(Path(where))

    async def check(self, incoming: frozenset[str], workspace: str | None):
        """Cleanup and floor check on the state file system, then the workspace's (if
        another): the refusal, or None."""
        d = self.disk
        refusal = admission(await self.cleanup(str(d.state_dir), incoming), d.floor_bytes)
        root = self._own_root(workspace) if refusal is None else None
        if root is not None:
            sample = await self.cleanup(root, incoming)
            refusal = admission(sample, self.floors(root, sample)[0], _on(root))
        return refusal

    def check_now(self, workspace: str | None):
        """`check` when neither file system needs a cleanup (it never waits: the actor's
        `handle_now`); LATER when one does."""
        refusal = self._admission_now(str(self.disk.state_dir))
        root = self._own_root(workspace) if refusal is None else None
        if root is not None:
            refusal = self._admission_now(root, _on(root))
        return refusal

    def _admission_now(self, where: str, named: str = STATE_FS):
        """The floor check on one probe (`cleanup`'s first step); LATER if a cleanup is due."""
        sample = self.disk.probe(Path(where))
        floor, goal = self.floors(where, sample)
        if CleanupRun(floor, goal).needed(sample):
            return LATER
        return admission(sample, floor, named)

    def floors(self, where: str, sample: DiskSample) -> tuple[int, int]:
        """The floor and goal of `where`'s file system: the state dir's, or a workspace
        root's own when it is on another file system (`floors_for`: the configured ones, or
        by default the share of that file system: docs/disk.md, "Admission")."""
        d = self.disk
        if (d.floors_for is None or where == str(d.state_dir)
                or device(where) == self._state_device()):
            return d.floor_bytes, d.goal_bytes
        return d.floors_for(sample.total_bytes)

    def _state_device(self) -> int | None:
        """The state dir's device, read once: it holds the runner's open database, so it is
        not mounted over while the runner runs (two checks a job, each a stat(2) less)."""
        if self._state_dev is None:
            self._state_dev = device(str(self.disk.state_dir))
        return self._state_dev

    def _own_root(self, workspace: str | None) -> str | None:
        """The workspace's root when it is on a file system other than the state dir's."""
        d = self.disk
        root = d.names.root_of(workspace) if workspace else None
        if root is not None and device(root) not in (None, self._state_device()):
            return root
        return None


def _on(root: str) -> str:
    """A workspace root's file system, as a refusal's detail names it."""
    return f"the filesystem of workspace root {root}"
