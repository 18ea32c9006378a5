"""One actor per job setting up or running, the shell that carries its messages: setup and
spawn, `running`, output.log into the store batch by batch until the keeper exits, status.json
to the terminal record (rules: execution/core.py; file work: jobdir.py, `JobDeps.offload`)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import trio

import actors
from .. import faults
from ..accounting.actor import JobStarted
from ..lifecycle import RUNNING
from ..offload import offload_unless
from ..records import JobRecord, Refusal, Started
from . import core, jobdir, joblog, messages
from .messages import Cancel, JobDeps, awaiting_exit, release_isolation, save_when_room, terminal_save
from .spawner import JobDirClaimed, KeeperNotStarted, SpawnerError

log = logging.getLogger("motor.execution")

_ERRORS = ((JobDirClaimed, "claimed"), (KeeperNotStarted, "not_started"), (SpawnerError, "spawner"))


class JobExecution(actors.Actor):
    inbox_size = 8

    def __init__(self, record: JobRecord, deps: JobDeps, *, fresh: bool = False):
        super().__init__(name=f"job-{record.job_id}")
        self.deps, self.dir, self.fresh = deps, deps.jobs_dir / record.job_id, fresh
        self.run_state = core.JobRun(record, record.job_id in deps.cancels, deps.config, self.dir)
        self.save = functools.partial(save_when_room, deps.store, self.name, self.run_state)

    record = property(lambda self: self.run_state.record)
    keeper = property(lambda self: self.run_state.keeper)

    immediate = (Cancel,)  # its only message, answered in the sender's task (`main`)

    def handle_now(self, msg):
        if isinstance(msg, Cancel):
            if self.run_state.cancel() == core.SIGNAL:
                return self.deps.spawner.cancel(*self.keeper, self.dir)
            return True
        raise TypeError(f"{self.name}: unknown message {msg!r}")

    async def main(self):
        """The job's life, in the actor's own task: until it ends, goes back to the queue, or
        the runner stops under it (`messages.left_to_the_next_start`)."""
        with messages.left_to_the_next_start(self.deps, self.name):
            deps, job_id = self.deps, self.record.job_id
            if self.record.terminal:  # an incarnation before this one recorded its end, then crashed
                return await release_isolation(deps, job_id, self.name)
            await faults.ahit("setup.look", when=not self.fresh)  # tests: which starts look
            found = jobdir.look_at_start(self.dir, self.fresh, self.record.state == RUNNING)
            if found.kill_strays:  # a start cut short, or a claim that names no keeper
                await deps.offload(jobdir.kill_strays, deps.spawner, job_id, self.name, found.claim_error)
            if not found.adopt and (found := await self._setup()) is None:
                return  # it ended, or went back to the queue
            if found.adopt:
                self.run_state.follow(found.keeper)
                log.info("%s: adopted (keeper %s)", self.name, self.keeper)
                await deps.offload(jobdir.adopt_groups, deps.backend, job_id, self.dir, self.name)
                if self.record.state != RUNNING:
                    await self._mark_running(found.started_at_ms)
            if self.run_state.cancel_due():
                deps.spawner.cancel(*self.keeper, self.dir)
            await self._follow(not found.adopt and self.record.attempts == 1)  # keeper.md
            await self._finish(claim_error=found.claim_error)

    async def _setup(self) -> core.Found | None:
        """Set up, spawn: Found (adopt: a keeper held the directory), None: ended or requeued."""
        deps, record, io, progress = self.deps, self.record, self.deps.offload, jobdir.Progress()
        try:
            await faults.ahit("setup.begin")  # tests: a barrier or a crash at this point
            cwd, bundle, root = deps.workspace_root / record.workspace, None, None
            if deps.disk is not None:  # disk check again before setup; catalog the workspace
                plan = await deps.disk.prepare_setup(
                    record.job_id, record.workspace, record.siblings,
                    kind=record.workspace_kind, bundle_sha256=record.bundle_sha256)
                if plan.refusal is not None:
                    return await self._end_in_setup(plan.refusal)
                cwd, bundle, root = Path(plan.path), plan.bundle, plan.root
            if self.run_state.setup_cancelled():
                return await self._end_in_setup()
            # workspace, the backend's groups and limits, spec.json: one hop, or none (jobdir)
            if refusal := await offload_unless(
                    jobdir.set_up_is_light(deps.backend, bundle, record), io, jobdir.set_up, record,
                    cwd, self.dir, bundle, root, deps.backend, deps.config, progress):
                return await self._end_in_setup(refusal)
            if self.run_state.setup_cancelled():
                await io(deps.backend.finish, record.job_id)
                return await self._end_in_setup()
            self.run_state.spawning()
            handle = await deps.spawner.spawn(self.dir)
        except Exception as exc:
            return await self._start_error(exc, progress.prepared)
        self.run_state.follow((handle.pid, handle.create_time))
        await faults.ahit("setup.spawned")  # tests/bench: a crash before keeper.json may exist
        await self._mark_running(None)
        return core.Found(adopt=False)

    async def _start_error(self, exc: Exception, prepared: bool) -> core.Found | None:
        deps, job_id = self.deps, self.record.job_id
        error = next((kind for cls, kind in _ERRORS if isinstance(exc, cls)), "other")
        claim = error == "spawner" and await deps.offload(jobdir.claimed, self.dir)
        outcome = core.after_start_error(error, claim, self.run_state.cancel_requested)
        if outcome == core.ADOPT:
            log.warning("%s: a keeper holds the job directory (%s): adopting it", self.name, exc)
            return await deps.offload(jobdir.adopt_claim, self.dir, deps.spawner, job_id, self.name)
        if outcome == core.SPAWN_FAILED:  # the identity is not durable: the job never ran
            return await self._finish(core.spawn_failed_status(str(exc)))
        log.warning("%s: start failed: %s", self.name, exc)
        if prepared:  # remove the job's groups again
            await deps.offload(deps.backend.finish, job_id)
        if outcome == core.CANCELLED:
            return await self._end_in_setup()
        await deps.cpu.release(job_id)  # requeued with its retry delay
        await deps.dispatcher.start_failed(job_id, f"{type(exc).__name__}: {exc}")

    async def _end_in_setup(self, refusal: Refusal | None = None) -> None:
        """Refused at the setup check, or (no refusal) cancelled: it never starts."""
        now = self.deps.clock.now_ms()
        await self._end(core.ended_in_setup(self.record, refusal, now, self.name))

    async def _end(self, record: JobRecord) -> None:
        """The job's end: capacity first (whoever sees it sees the permits free), then the store."""
        self.run_state.record = record
        self.deps.cancels.discard(record.job_id)
        log.info("%s", core.ended_line(self.name, record))
        await self.deps.cpu.release(record.job_id)
        save = terminal_save(self.run_state, record)  # with the next job's start, if one:
        if not await self.deps.dispatcher.finished(record.job_id, save):
            await self.save(save)
        self.deps.accounting.ended(record)

    async def _mark_running(self, started_at_ms: int | None) -> None:
        r = self.run_state.record = core.running_record(
            self.record, started_at_ms, self.deps.clock.now_ms(), self.name)
        # saved with the job's next write: its output, its end, or alone after a quiet poll
        self.run_state.defer([Started(cpus=r.cpus, attempt=r.attempts)])
        await self.deps.dispatcher.setup_done(r.job_id)
        self.deps.accounting.started(JobStarted(
            r.job_id, r.repository, r.workspace, r.claim, r.started_at_ms, r.queue_wait_ms))

    async def _follow(self, first: bool):
        """Output batches every output poll (`JobRun.poll_s`) till the keeper is done, then the
        rest (`first`: from 0)."""
        offset, quiet = 0 if first else self.deps.records.log_offset(self.record.job_id), False
        async with awaiting_exit(self.deps.spawner, self.keeper, self.dir) as done:
            while not done.is_set():
                offset = await self._drain(offset)
                if quiet and self.run_state.unsaved:  # a poll in, no output: the start alone
                    await self.save(self.record)
                if not done.is_set():
                    quiet = True  # at the next pass the job has run a poll or ended
                    with trio.move_on_after(self.run_state.poll_s):
                        await done.wait()
        await self._drain(offset, last=True)

    async def _drain(self, offset: int, last: bool = False) -> int:
        """The log from `offset` into events, a batch at a time, each saved with the offset after
        it before the next is read (a restart resumes after it), up to the size an inline stat
        saw; the `last` drain's final batch goes with the terminal record (JobRun.defer)."""
        output, size = self.run_state.output, jobdir.log_size(self.dir)
        while output.error is None and (size is None or offset < size):
            small = size is not None and size - offset <= jobdir.INLINE_READ_BYTES
            try:
                events, new = await offload_unless(small, self.deps.offload, jobdir.read_output,
                                                   self.dir, offset, core.READ_BATCH_BYTES, output)
            except (joblog.JobDirError, OSError) as exc:
                log.warning("%s: %s", self.name, output.stopped(offset, exc))
                break
            if new == offset:
                break
            if last and size is not None and new >= size:
                self.run_state.defer(events, new)
            else:
                await self.save(self.record, events, log_offset=new)
            offset = new
        return offset

    async def _finish(self, status: dict | None = None, claim_error: str | None = None) -> None:
        """The keeper exited (`status`: None, read status.json): the terminal record (with
        `claim_error`, why the runner stopped the job's processes when it adopted it)."""
        deps, job_id = self.deps, self.record.job_id
        status, unreadable = jobdir.read_status(self.dir, self.name, status)
        if (facts := jobdir.close_quick(deps.backend, job_id, status, self.name)) is None:
            status, facts = await offload_unless(
                jobdir.close_is_light(deps.backend, status), deps.offload, jobdir.close,
                self.dir, deps.spawner, deps.backend, job_id, status, self.name)
        record = core.terminal_record(self.record, status, deps.clock.now_ms(), facts,
                                      self.run_state.output.error, unreadable, claim_error)
        await self._end(record)
        if deps.disk is not None:  # idle now: measure it, apply the build-folder cap
            await deps.disk.job_idle(job_id, record.workspace, record.siblings)
        await release_isolation(deps, job_id, self.name, status)  # off the end path
