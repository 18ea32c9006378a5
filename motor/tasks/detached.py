"""Hosting TurnRunners: the attached/library entry (`run_turn`) and the detached runner
process's main loop (`python -m motor worker runner TASK TURN --slot-token T`).  Each queue
step is one message to the queue actor (motor.tasks.sections)."""

from __future__ import annotations

import sys
import uuid

import trio

from motor.tasks import core, sections
from motor.tasks.client import TaskClient
from motor.tasks.records import TurnRecord
from motor.tasks.turn import TurnRunner


async def host_turn(tc: TaskClient, task_id: str, turn_id: str, *, echo: bool = False,
                    reassign: bool = False, wait_for_worker: bool | None = None) -> TurnRunner:
    """Host one TurnRunner in a nursery until its turn ends; the runner tells which task it
    ended up running (a donation moves it) and any error."""
    runner = TurnRunner(tc, task_id, turn_id, echo=echo, reassign=reassign, wait_for_worker=wait_for_worker)
    async with trio.open_nursery() as n:
        await n.start(runner.run)
        await runner.done.wait()
    return runner


async def run_turn(tc: TaskClient, task_id: str, turn_id: str, *, echo: bool = False) -> TurnRecord | None:
    """Attached/library execution: runs exactly the requested turn (never donates)."""
    runner = await host_turn(tc, task_id, turn_id, echo=echo, reassign=False, wait_for_worker=False)
    if runner.error is not None:
        raise runner.error
    return runner.result


async def take_over_reserved_slot(tc: TaskClient, task_id: str, turn_id: str, token: uuid.UUID) -> None:
    """The detached child's first message: take the reserved slot (core rules), and finish
    the handoff itself (record task.runner, clear the token): idempotent with the parent."""
    me = tc.me
    await tc.queue.locked(lambda L: sections.take_over_locked(L, task_id, turn_id, token, me))


async def start_next_parked(tc: TaskClient, finished_task: str) -> tuple[str, str] | None:
    """A finishing runner replaces its own slot: reserve the oldest parked turn with
    exclude_reserver TRUE and, when acquired, take it over in this same process (no new
    process: the count of runner processes never exceeds the cap, even for an instant)."""
    me, cap, mp = tc.me, tc.cap, tc.fleet.max_parallel
    return await tc.queue.locked(lambda L: sections.next_parked_locked(L, me, cap, mp, tc.new_token, finished_task))


async def retire(tc: TaskClient, task_id: str) -> None:
    """Clear task.runner when it is still us."""
    me = tc.me
    await tc.queue.locked(lambda L: sections.retire_locked(L, task_id, me))


async def detached_runner(tc: TaskClient, task_id: str, turn_id: str, token: uuid.UUID) -> int:
    """`python -m motor worker runner TASK TURN --slot-token T`: take over the reserved
    slot, run the turn, then keep replacing our own slot with parked turns."""
    try:
        await take_over_reserved_slot(tc, task_id, turn_id, token)
    except core.QueueError as exc:
        sys.stderr.write(f"motor worker runner: refused: {exc}\n")
        return 3
    current: tuple[str, str] | None = (task_id, turn_id)
    while current is not None:
        runner = await host_turn(tc, *current, reassign=tc.reassign, wait_for_worker=True)
        if runner.error is not None:
            # contract 5: the durable rows stay as published (recoverable); exit with an
            # error, reconcile replaces this process once it is gone
            sys.stderr.write(f"motor worker runner: task {runner.task_id} turn {runner.turn_id}: "
                             f"{runner.error}\n")
            return 1
        if runner.result is None:  # the turn went back to the queue (no worker answered): stop here
            await retire(tc, runner.task_id)
            return 0
        current = await start_next_parked(tc, runner.task_id)
    return 0


__all__ = ["host_turn", "run_turn", "take_over_reserved_slot", "start_next_parked", "retire", "detached_runner"]
