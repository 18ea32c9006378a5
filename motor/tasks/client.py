"""TaskClient: the task client's operations (submit, turn, start, reconcile, cancel) for one
process on one client dir.  A thin shell: each operation is one message to the queue actor
(a body in motor.tasks.sections deciding with motor.tasks.rules / core), then the I/O that
must happen outside the lock (spawning a runner: motor.tasks.host; cancelling jobs on
workers: motor.tasks.remote)."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Callable

import trio

from motor.tasks import core, remote, sections
from motor.tasks.host import Spawner, real_spawner
from motor.tasks.queue import QueueHandle
from motor.tasks.records import ProcessIdentity, TaskRecord, TurnRecord
from motor.tasks.store import ClientDir, my_identity, new_token, now_ms
from motor.tasks.workers import Fleet


@dataclass
class StartResult:
    outcome: str              # spawned | parked | pending | attached | failed
    detail: str = ""
    child: ProcessIdentity | None = None


class TaskClient:
    """The task client's operations on one client dir, for one process (`me`).  Injected:
    `spawner` (starts a detached runner), `probe` (a worker's health), tokens and clock."""

    def __init__(self, cdir: ClientDir, queue: QueueHandle, fleet: Fleet, *,
                 me: ProcessIdentity | None = None, spawner: Spawner | None = None,
                 token_source: Callable[[], uuid.UUID] = new_token, clock: Callable[[], int] = now_ms,
                 probe: remote.Probe = remote.probe_health):
        self.cdir = cdir
        self.queue = queue
        self.fleet = fleet
        self.me = me or my_identity()
        self.spawner = spawner or real_spawner(cdir)
        self.new_token = token_source
        self.clock = clock
        self.probe = probe
        # seed 001: a detached runner may donate its process while it waits (opt-in; the
        # benchmark's comparison switches it off with MOTOR_TASK_REASSIGN=0)
        self.reassign = os.environ.get("MOTOR_TASK_REASSIGN", "1") != "0"
        self.poll_interval = 0.5

    @property
    def cap(self) -> int:
        """Detached cap: the number of workers."""
        return len(self.fleet.workers)

    # -- creating work ------------------------------------------------------------------

    async def create_task(self, project: str, command: list[str], *, pin: str | None = None,
                          run: str | None = None, attached: bool = False,
                          capabilities: list[str] | None = None) -> tuple[str, str]:
        task_id = uuid.uuid4().hex[:16]
        now = self.clock()
        task = TaskRecord(task_id=task_id, project=project, created_at_ms=now, pin=pin, run=run,
                          capabilities=sorted(set(capabilities or [])),
                          workspace=f"task-{task_id}",
                          turns=[TurnRecord(turn_id="1", command=command, submitted_at_ms=now)])
        me = self.me
        await self.queue.locked(lambda L: sections.submit_locked(L, task, me, now, attached))
        return task_id, "1"

    async def add_turn(self, task_id: str, command: list[str]) -> str:
        now, me = self.clock(), self.me
        return await self.queue.locked(lambda L: sections.add_turn_locked(L, task_id, command, me, now))

    # -- starting runners ---------------------------------------------------------------

    async def start_turn(self, task_id: str, turn_id: str) -> StartResult:
        """Submit's start: reserve; Acquired -> spawn outside the lock and hand off;
        Saturated (or not eligible yet) -> park; Pending -> someone else has it."""
        me, cap, mp = self.me, self.cap, self.fleet.max_parallel
        r = await self.queue.locked(lambda L: sections.start_locked(L, task_id, turn_id, me, cap, mp,
                                                                    self.new_token))
        if r.kind == "saturated":
            return StartResult("parked")
        if r.kind == "pending":
            return StartResult("pending", f"step {r.step}")
        return await self.spawn_and_hand_off(task_id, turn_id, r.token)

    async def spawn_and_hand_off(self, task_id: str, turn_id: str, token: uuid.UUID) -> StartResult:
        try:
            child = await trio.to_thread.run_sync(self.spawner, task_id, turn_id, token)
        except Exception as exc:  # noqa: BLE001 - spawn failed: give the slot back
            await self.release(task_id, turn_id, token)
            return StartResult("failed", f"cannot start a runner: {exc}")
        try:
            await self.complete_runner_spawn(task_id, turn_id, token, child)
        except core.QueueError as exc:
            await self.release(task_id, turn_id, token)  # a no-op once the child is bound
            return StartResult("failed", str(exc), child)
        return StartResult("spawned", child=child)

    async def complete_runner_spawn(self, task_id: str, turn_id: str, token: uuid.UUID,
                                    child: ProcessIdentity, *, mode: str = "detached") -> bool:
        """Adopt the child if needed, bind it on the reservation, publish (reservation still
        present), persist task.runner, clear that token, publish again."""
        return await self.queue.locked(
            lambda L: sections.complete_locked(L, task_id, turn_id, token, child, mode))

    async def release(self, task_id: str, turn_id: str, token: uuid.UUID) -> bool:
        me = self.me
        return await self.queue.locked(lambda L: core.release_runner_slot(
            L.queue, task_id=task_id, turn_id=turn_id, token=token, reserver=me))

    async def reconcile(self) -> list[StartResult]:
        """Replace dead runners of active turns, then start the oldest parked turns while
        slots are free (exclude_reserver false: the reconciler's own slot counts)."""
        me, cap, mp = self.me, self.cap, self.fleet.max_parallel
        starts = await self.queue.locked(lambda L: sections.reconcile_plan(L, me, cap, mp, self.new_token))
        return [await self.spawn_and_hand_off(t, u, tok) for t, u, tok in starts]

    async def cancel(self, task_id: str) -> list[tuple[str, str]]:
        """Queued turns of the task leave the queue as cancelled; a dispatched one is marked
        and its runner job cancelled on its worker.  Returns [(worker, job_id)] to cancel."""
        now = self.clock()
        jobs = await self.queue.locked(lambda L: sections.cancel_locked(L, task_id, now))
        await remote.cancel_jobs(self.fleet, jobs)
        return jobs


__all__ = ["TaskClient", "StartResult"]
