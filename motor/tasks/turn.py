"""The TurnRunner actor: runs one task turn on a worker.  A thin shell: the decisions are
pure (motor.tasks.rules, motor.tasks.core), every queue change is one message to the queue
actor (motor.tasks.sections), the worker HTTP is motor.tasks.remote and the turn's files are
motor.tasks.host.TurnFiles."""

from __future__ import annotations

import sys

import trio

import actors
from motor.client import AsyncClient, RunnerUnavailable
from motor.records import Accepted, Output, RefusedError, Started, Terminal, Truncated
from motor.tasks import context, core, remote, rules, sections
from motor.tasks.client import TaskClient
from motor.tasks.host import TurnFiles
from motor.tasks.records import QueueEntry, TaskRecord, TurnRecord


class TurnRunner(actors.Actor):
    """Runs one turn: chooses a worker, dispatches the turn as a runner job (bundle of the
    project worktree, workspace named for the task), streams its output into
    C/turns/<task>/<turn>/, imports the terminal record, and removes the row.  `result`: the
    turn's final TurnRecord (None: it went back to the queue, e.g. no worker answered).
    `echo`: write the output to our stdout/stderr too (attached)."""

    def __init__(self, tc: TaskClient, task_id: str, turn_id: str, *, echo: bool = False,
                 reassign: bool = False, wait_for_worker: bool | None = None):
        super().__init__(name=f"turn-{task_id}-{turn_id}")
        self.tc = tc
        self.task_id = task_id
        self.turn_id = turn_id
        self.echo = echo
        self.reassign = reassign
        # detached: wait until a worker is ready for the turn (one of this client's turns per
        # worker at a time); attached: dispatch at once (the worker queues it when busy)
        self.wait_for_worker = reassign if wait_for_worker is None else wait_for_worker
        self.donations: list[tuple[str, str]] = []   # (donor task, recipient task)
        self.result: TurnRecord | None = None
        self.error: BaseException | None = None
        self.done = trio.Event()

    async def on_start(self) -> None:
        self.nursery.start_soon(self._main)

    async def handle(self, msg):
        if msg == "statistics":
            return {"task": self.task_id, "turn": self.turn_id, "done": self.done.is_set()}
        raise ValueError(f"unknown message {msg!r}")

    async def _main(self) -> None:
        try:
            self.result = await self._run()
        except (core.QueueError, context.ContextError, OSError) as exc:
            self.error = exc  # the hosting process reports it and exits with an error
        finally:
            self.done.set()
            self.stop()

    def _locked(self, fn, *args, **kw):
        """One queue section on this runner's turn: `fn(L, task_id, turn_id, *args, **kw)`."""
        task_id, turn_id = self.task_id, self.turn_id
        return self.tc.queue.locked(lambda L: fn(L, task_id, turn_id, *args, **kw))

    async def _run(self) -> TurnRecord | None:
        tc = self.tc
        task = await trio.to_thread.run_sync(tc.cdir.read_task, self.task_id)
        if task is None:
            return None
        row = await self._locked(sections.row_copy)
        way = rules.route(row, tc.me, wait_for_worker=self.wait_for_worker)
        if way == "claim":
            claimed = await self._claim(task, row)
            way = claimed if isinstance(claimed, str) else way   # gone | cancelled | a claim
        if way == "gone":
            return None
        if way == "cancelled":
            return await self._finish(dict(state="cancelled", reason="cancelled"))
        if way == "claim":
            if claimed.kind == "move":  # this process now runs the recipient's turn
                self.donations.append((self.task_id, claimed.task_id))
                self.task_id, self.turn_id = claimed.task_id, claimed.turn_id
                task = await trio.to_thread.run_sync(tc.cdir.read_task, self.task_id)
            row = claimed.row
        elif (row := await self._dispatch_now(task, row)) is None:
            return None
        return await self._execute(task, row)

    async def _own_reports(self, task: TaskRecord, row: QueueEntry) -> dict | None:
        """Observe the turn's own workers: their health reports, or None when none answers
        (the turn then goes back to the queue with the errors as its detail)."""
        reports: dict = {}
        errors: list = []
        await remote.observe(self.tc.probe, rules.own_candidates(self.tc.fleet, task, row), reports, errors)
        if reports:
            return reports
        detail = rules.unreachable_detail(errors)
        await self._locked(sections.park_back_locked, self.tc.me, detail, dispatched=False)
        if self.echo:
            sys.stderr.write(f"motor: {detail}; the turn stays queued\n")
        return None

    async def _dispatch_now(self, task: TaskRecord, row: QueueEntry) -> QueueEntry | None:
        """Attached execution and re-attach: dispatch at once (a busy worker queues the job)."""
        reports = await self._own_reports(task, row)
        return None if reports is None else await self._locked(sections.dispatch_locked, self.tc.me, reports)

    def _claim_locked(self, reports: dict, reassign: bool):
        return self._locked(lambda L, task, turn: sections.claim_locked(L, self.tc.fleet, task, turn, self.tc.me,
                                                                       dict(reports), reassign=reassign))

    async def _claim(self, task: TaskRecord, row: QueueEntry):
        """The detached runner's wait (seed 001, contract 2): observe its own worker(s); claim
        under the lock (keep -> dispatch); after a miss, and only when parked work exists,
        observe the rest of the fleet (keeping this iteration's observations) and claim
        again, which may donate this process to a parked turn.  Otherwise wait a poll
        interval and start a new iteration.  "gone": parked (no worker answers) or no longer
        ours; "cancelled": cancel was asked while it waited."""
        tc = self.tc
        while True:
            if (reports := await self._own_reports(task, row)) is None:
                return "gone"
            claimed = await self._claim_locked(reports, self.reassign)
            if claimed.kind != "wait":
                return claimed
            after = rules.after_miss(await self._locked(sections.row_copy), tc.me)
            if after != "wait":
                return after
            parked = await tc.queue.locked(sections.parked_exists)
            rest = rules.rest_of_fleet(tc.fleet, rules.own_candidates(tc.fleet, task, row), reports)
            if self.reassign and parked and rest:
                await remote.observe(tc.probe, rest, reports, [])
                claimed = await self._claim_locked(reports, True)
                if claimed.kind != "wait":
                    return claimed
            await trio.sleep(tc.poll_interval)

    async def _execute(self, task: TaskRecord, row: QueueEntry) -> TurnRecord | None:
        tc = self.tc
        spec = tc.fleet.get(row.worker)
        assert spec is not None
        files = TurnFiles(tc.cdir.turn_dir(self.task_id, self.turn_id), echo=self.echo)
        await trio.to_thread.run_sync(files.prepare)
        try:
            async with remote.worker_client(spec) as client:
                job_id = row.job_id or await self._find_orphan_job(client, task)
                if job_id is not None:
                    stream = await client.events(job_id, 0)
                else:
                    stream = await remote.submit_turn(client, tc.cdir, task, self.turn_id)
                terminal = await self._follow(stream, files, client)
        except RefusedError as exc:
            return await self._finish(dict(state="refused", reason=exc.refusal.code, detail=exc.refusal.detail))
        except context.ContextError as exc:  # a redirected/mismatched saved worktree: never run elsewhere
            return await self._finish(dict(state="refused", reason=exc.code, detail=exc.detail))
        except RunnerUnavailable as exc:
            detail = f"worker {spec.name} unreachable at {spec.endpoint}: {exc}"
            await self._locked(sections.park_back_locked, tc.me, detail, dispatched=True)
            return None
        if terminal is None:
            return await self._finish(dict(state="lost", reason="stream_ended",
                                           detail="the worker closed the stream before the job ended"))
        await trio.to_thread.run_sync(files.record, terminal.record)
        return await self._finish(rules.turn_outcome(terminal.record))

    async def _find_orphan_job(self, client: AsyncClient, task: TaskRecord) -> str | None:
        """A turn dispatched by a runner that died before recording the job id: the job in
        the task's workspace that no earlier turn owns is this turn's (rules.orphan_job)."""
        row = await self._locked(sections.row_copy)
        if row is None or row.worker is None or not rules.may_own_orphan(task, self.turn_id):
            return None
        return rules.orphan_job(await remote.all_jobs(client), task, self.turn_id)

    async def _follow(self, stream, files: TurnFiles, client: AsyncClient) -> Terminal | None:
        with files:
            async with stream:
                async for event in stream:
                    files.event(event)
                    if isinstance(event, Accepted):
                        if await self._locked(sections.record_job_locked, self.tc.me, event.job_id):
                            await client.cancel(event.job_id)
                    elif isinstance(event, Started):
                        await self._locked(sections.update_turn, state="running", started_at_ms=self.tc.clock())
                    elif isinstance(event, Output):
                        files.output(event.stream, event.raw())
                    elif isinstance(event, Truncated):
                        files.truncated()
                    elif isinstance(event, Terminal):
                        return event
        return None

    async def _finish(self, changes: dict) -> TurnRecord | None:
        return await self._locked(sections.finish_locked, self.tc.me, self.tc.clock(), changes)


__all__ = ["TurnRunner"]
