"""One actor per running job: setup, spawn under the keeper, output, terminal record.

Theory of operation
-------------------
The dispatcher has already placed the job's CPUs and saved the record in state `setup`
(a job is recorded before its CPUs are used). This actor then:

1. setup: creates the workspace directory and the job directory, writes the keeper's
   `spec.json` (command, cwd, environment, CPUs, isolation fields, timeout) and asks the
   forkserver for a keeper. A failure here is a failed start: the dispatcher requeues the
   job with its retry delay, the CPUs are released. A cancel that arrives before the keeper
   is spawned ends the job `cancelled` here, without a `started` event.
2. running: saves the record as `running` with a `started` event, tells the dispatcher.
3. follow: turns the keeper's `output.log` into numbered `output` events (the log offset is
   saved in the same transaction as the events), until the keeper exits.
4. end: reads `status.json`, saves the terminal record and event, releases CPUs, tells the
   dispatcher and accounting, and stops.

The keeper, not this actor, owns the job's output and exit status, so the job outlives the
runner. After a restart (or a crash of this actor: it is a transient child and comes back
in adopt mode) the actor starts at step 3 from the saved log offset whenever the job
directory holds a keeper's claim (keeper.json); without one no keeper was ever released,
and the job is set up again (docs/keeper.md, "Start protocol").
"""

from __future__ import annotations

import codecs
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

import msgspec

import actors

from .. import faults
from ..accounting.actor import JobEnded, JobStarted, notify
from ..accounting.core import with_reservation_use
from ..cpu.actor import Release
from ..disk.actor import JobIdle, PrepareSetup
from ..disk.bundles import BundleError, unpack_into
from ..scheduling.messages import Finished, SetupDone, StartFailed
from ..store.actor import Save
from ..store.db import StoreFull
from ..store.files import job_umask
from ..lifecycle import (
    CANCEL, REFUSE, RUNNING, SPAWN, advance, retain_until, terminal_from_status,  # noqa: F401 (re-exported)
)
from ..records import Refusal, JobRecord, Output, Started, Terminal, public_record
from . import joblog
from .ports import Offload, thread_offload
from .spawner import JobDirClaimed, KeeperNotStarted, SpawnerError

log = logging.getLogger("motor.execution")

POLL_S = 0.02  # output tail interval while a job runs
READ_BATCH_BYTES = joblog.READ_MAX_BYTES  # output.log bytes turned into events per store call
STORE_FULL_RETRY_S = 1.0  # a save refused for lack of space is retried after this


@dataclass(frozen=True)
class Cancel:
    """Reply: True when a signal was sent (or will be, once the keeper exists)."""


@dataclass
class JobDeps:
    """What every job actor needs: the other actors' refs and the shared resources."""

    config: Any
    db: Any
    store: Any  # ActorRef of the store
    dispatcher: Any  # ActorRef of the dispatcher
    cpu: Any
    accounting: Any
    spawner: Any
    backend: Any
    clock: Any
    jobs_dir: Path
    workspace_root: Path
    disk: Any = None  # ActorRef of the disk actor (setup admission, bundles, idle workspaces)
    #: runs blocking work (file system, isolation backend) away from the event loop
    offload: Offload = thread_offload


def job_dir(deps: JobDeps, job_id: str) -> Path:
    return deps.jobs_dir / job_id


class JobExecution(actors.Actor):
    inbox_size = 8

    def __init__(self, record: JobRecord, deps: JobDeps):
        super().__init__(name=f"job-{record.job_id}")
        self.record = record
        self.deps = deps
        self.dir = job_dir(deps, record.job_id)
        self.keeper: tuple[int, float] | None = None
        self.cancel_requested = False
        self.output_error: str | None = None  # output.log could not be parsed: output stopped
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace")
                          for s in ("stdout", "stderr")}

    async def on_start(self):
        self.nursery.start_soon(self._life)

    async def handle(self, msg):
        if isinstance(msg, Cancel):
            self.cancel_requested = True
            if self.keeper is not None:
                return self.deps.spawner.cancel(*self.keeper, self.dir)
            return True
        raise TypeError(f"{self.name}: unknown message {msg!r}")

    # -- the job's life -----------------------------------------------------------------

    def _kept(self) -> dict | None:
        """What the job directory says about a keeper: keeper.json (the claim, written
        before any keeper may start the job), {} when only status.json is there, None when
        no keeper was ever released for this job."""
        kept = joblog.read_keeper(self.dir) if (self.dir / "keeper.json").exists() else None
        if kept is None and (self.dir / "status.json").exists():
            kept = {}
        return kept

    async def _life(self):
        kept = self._kept()
        if kept is None:
            if self.dir.exists():
                # A start cut short (runner restart, failed start): no keeper was released
                # (the claim comes first), but make sure nothing of this job still runs
                # before it is spawned again.
                killed = await self.deps.offload(
                    self.deps.spawner.kill_marked, self.record.job_id)
                if killed:
                    log.warning("%s: killed %d stray process(es) of the job before its start: %s",
                                self.name, len(killed), killed)
            started = await self._setup()
            if started is None:
                self.stop()
                return
            if started == "claimed":  # another keeper holds the job: adopt it
                kept = self._kept() or {}
        if kept is not None:
            if kept:
                self.keeper = (kept["keeper_pid"], kept["keeper_create_time"])
            log.info("%s: adopted (keeper %s)", self.name, self.keeper)
            if not await self.deps.offload(self.deps.backend.adopt, self.record.job_id):
                log.warning("%s: its isolation group is gone; following it without one", self.name)
            if self.record.state != RUNNING:
                await self._mark_running(kept.get("started_at_ms"))
        if self.cancel_requested and self.keeper is not None:
            self.deps.spawner.cancel(*self.keeper, self.dir)
        await self._follow()
        await self._finish()
        self.stop()

    async def _setup(self) -> str | None:
        """Set the job up and spawn its keeper: "spawned", "claimed" (a keeper already
        holds the job directory: adopt it) or None (the job ended or went back to the
        queue)."""
        deps, record = self.deps, self.record
        prepared = False
        try:
            await faults.ahit("setup.begin")  # tests: a barrier or a crash at this point
            cwd = deps.workspace_root / record.workspace
            if deps.disk is not None:  # disk check again before setup; catalog the workspace
                plan = await deps.disk.call(PrepareSetup(
                    record.job_id, record.workspace, tuple(record.siblings),
                    kind=record.workspace_kind, bundle_sha256=record.bundle_sha256), timeout=600)
                if plan.refusal is not None:
                    await self._refuse_setup(plan.refusal)
                    return None
                cwd = Path(plan.path)  # a caller-root workspace lives in its host directory
            if self.cancel_requested:  # cancelled during setup: it never starts
                await self._cancel_in_setup()
                return None
            cwd.mkdir(parents=True, exist_ok=True)
            if deps.disk is not None and plan.bundle is not None:
                try:  # the bundle becomes the workspace's source before anything runs
                    await deps.offload(
                        unpack_into, Path(plan.bundle), str(cwd), plan.root, record.job_id)
                except BundleError as exc:
                    await self._refuse_setup(Refusal(code="workspace_setup_failed", detail=str(exc)))
                    return None
            self.dir.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            env.update(record.env)
            env["MOTOR_JOB_ID"] = record.job_id
            env["MOTOR_WORKSPACE"] = record.workspace
            env["MOTOR_VCPUS"] = str(record.claim)
            if deps.config is not None and getattr(deps.config, "compile_cache", None):
                env["MOTOR_COMPILE_CACHE"] = deps.config.compile_cache
            if record.cpus:
                env["MOTOR_CPUS"] = ",".join(map(str, record.cpus))
            spec = {
                "job_id": record.job_id,
                "command": record.command,
                "cwd": str(cwd),
                "env": env,
                "cpus": record.cpus,
                "timeout_s": record.timeout_s,
                "kill_grace_s": 10.0,
                "umask": job_umask(),  # the operator's; the runner's own is 077
            }
            # the isolation backend confines the job (cgroup: its groups, limits, cgroup.procs)
            prepared = True
            spec.update(await deps.offload(
                deps.backend.prepare, record.job_id, record.cpus, record.memory_max_bytes))
            if self.cancel_requested:  # cancelled during setup: it never starts
                await deps.offload(deps.backend.finish, record.job_id)
                await self._cancel_in_setup()
                return None
            joblog.write_json_atomic(self.dir / "spec.json", spec)
            handle = await deps.spawner.spawn(self.dir)
        except JobDirClaimed:
            log.warning("%s: a keeper already holds the job directory: adopting it", self.name)
            return "claimed"
        except KeeperNotStarted as exc:  # the identity is not durable: the job never ran
            log.warning("%s: keeper not started: %s", self.name, exc)
            await self._finish({"exit_code": None, "signal": None, "reason": "spawn_failed",
                                "detail": str(exc), "started_at_ms": None, "ended_at_ms": None})
            return None
        except Exception as exc:  # a failed start: requeue with the retry delay
            if isinstance(exc, SpawnerError) and (self.dir / "keeper.json").exists():
                # the forkserver failed after the claim: the keeper may run the job
                log.warning("%s: spawn failed after the claim (%s): adopting the keeper",
                            self.name, exc)
                return "claimed"
            log.warning("%s: start failed: %s", self.name, exc)
            if prepared:  # remove the job's groups again
                await deps.offload(deps.backend.finish, record.job_id)
            await deps.cpu.call(_release(record.job_id))
            await deps.dispatcher.cast(StartFailed(record.job_id, f"{type(exc).__name__}: {exc}"))
            return None
        self.keeper = (handle.pid, handle.create_time)
        await faults.ahit("setup.spawned")  # tests/bench: a crash before keeper.json may exist
        await self._mark_running(None)
        return "spawned"

    async def _cancel_in_setup(self) -> None:
        """A cancel that arrived before the keeper was spawned: the job ends `cancelled`
        without a `started` event (its command never ran)."""
        log.info("%s: cancelled during setup", self.name)
        await self._end(advance(
            self.record, CANCEL, who=self.name, reason="cancelled", detail="cancelled during setup",
            ended_at_ms=self.deps.clock.now_ms(), waiting_on=None, waiting_on_job=None))

    async def _refuse_setup(self, refusal) -> None:
        """End the job refused_before_start (e.g. runner_disk_full at the setup check)."""
        deps = self.deps
        log.warning("%s: refused at setup: %s", self.name, refusal.line())
        record = advance(
            self.record, REFUSE, who=self.name, reason=refusal.code,
            detail=refusal.detail, ended_at_ms=deps.clock.now_ms(), waiting_on=None,
            waiting_on_job=None)
        await self._end(record)

    async def _end(self, record: JobRecord) -> None:
        """Make `record` the job's terminal record: capacity first (so whoever sees the
        terminal event also sees the permits free), then the store, then accounting."""
        deps = self.deps
        self.record = record
        await deps.cpu.call(_release(record.job_id))
        await deps.dispatcher.call(Finished(record.job_id))
        await self._store(_save(record, [Terminal(record=public_record(record))],
                                    retain_until_ms=retain_until(record)))
        notify(deps.accounting, JobEnded(record))

    async def _store(self, msg: Save):
        """Save through the store. While the state filesystem is full (StoreFull), wait and
        retry: meanwhile the job's output stays in output.log (the log offset is not
        advanced) and its exit in status.json, so nothing is lost and nothing crashes."""
        waited = False
        while True:
            try:
                return await self.deps.store.call(msg)
            except StoreFull as exc:
                if not waited:
                    log.warning("%s: waiting for space to record the job: %s", self.name, exc)
                    waited = True
                await trio.sleep(STORE_FULL_RETRY_S)

    async def _mark_running(self, started_at_ms):
        now = self.deps.clock.now_ms()
        self.record = advance(
            self.record, SPAWN, who=self.name, started_at_ms=started_at_ms or now,
            waiting_on=None, waiting_on_job=None)
        await self._store(_save(self.record, [Started(cpus=self.record.cpus,
                                                               attempt=self.record.attempts)]))
        await self.deps.dispatcher.cast(SetupDone(self.record.job_id))
        notify(self.deps.accounting, JobStarted(
            self.record.job_id, self.record.repository, self.record.workspace, self.record.claim,
            self.record.started_at_ms, self.record.queue_wait_ms))

    async def _follow(self):
        log_path = self.dir / "output.log"
        offset = self.deps.db.log_offset(self.record.job_id)
        done = trio.Event()

        async def watch_exit():
            if self.keeper is not None:
                await self.deps.spawner.wait_exit(*self.keeper, self.dir)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_exit)
            while True:
                finished = done.is_set()
                offset = await self._drain(log_path, offset)
                if finished:
                    break
                with trio.move_on_after(POLL_S):
                    await done.wait()

    async def _drain(self, log_path: Path, offset: int) -> int:
        """Turn the log from `offset` into output events, one bounded batch at a time.

        Each batch is at most `joblog.READ_MAX_BYTES` of the log; its events and the offset
        after it are saved in one transaction before the next batch is read, so a log of any
        size (e.g. gigabytes written while the runner was down) costs the runner one batch
        of memory, and a restart resumes after the last saved batch.

        A log that cannot be parsed (a corrupt record header) ends the job's output at the
        last good record: the reason goes into the terminal record's detail; the job is still
        followed to its exit status (a crash here would re-read the same offset forever).
        """
        while self.output_error is None:
            try:
                records, new_offset = joblog.read_records(log_path, offset, READ_BATCH_BYTES)
            except (joblog.JobDirError, OSError) as exc:
                log.warning("%s: output stopped: %s", self.name, exc)
                self.output_error = f"output stopped at byte {offset} of output.log: {exc}"
                return offset
            if not records:
                return offset
            events = []
            for stream, data in records:
                text = self._decoders[stream].decode(data)
                if text:
                    events.append(Output(stream=stream, data=text))
            del records
            await self._store(_save(self.record, events, log_offset=new_offset))
            offset = new_offset
        return offset

    async def _finish(self, status: dict | None = None):
        deps = self.deps
        if status is None:
            try:
                status = joblog.read_status(self.dir)
            except joblog.JobDirError as exc:
                log.warning("%s: %s", self.name, exc)
                status = None
        if status is None:
            # The keeper died without a status: whatever is left of its job must not
            # outlive the record that says the job is over (the cgroup backends drain
            # their groups in finish(); the marker finds the rest).
            killed = await deps.offload(deps.spawner.kill_marked, self.record.job_id)
            if killed:
                log.warning("%s: keeper lost; killed %d leftover process(es): %s",
                            self.name, len(killed), killed)
        facts = await deps.offload(
            deps.backend.finish, self.record.job_id, status.get("signal") if status else None)
        for problem in ("collect_error", "cleanup_error"):
            if facts.get(problem):
                log.warning("%s: isolation %s: %s", self.name, problem, facts[problem])
        if status is not None and facts.get("cpu_time_ms") is not None:
            status["cpu_time_ms"] = facts["cpu_time_ms"]  # the group's figure covers the whole tree
        record = terminal_from_status(self.record, status, deps.clock.now_ms(), facts)
        record = with_reservation_use(record, status)  # unchanged when unmeasured
        if self.output_error is not None:
            record = msgspec.structs.replace(record, detail="; ".join(
                d for d in (record.detail, self.output_error) if d))
        await self._end(record)
        if deps.disk is not None:  # idle now: measure it, apply the build-folder cap
            await deps.disk.cast(JobIdle(record.job_id, record.workspace, tuple(record.siblings)))
        log.info("%s: %s (exit %s, signal %s)", self.name, record.state, record.exit_code,
                 record.signal)


def _save(record, events=(), **kw):
    return Save(record=record, events=list(events), **kw)


def _release(job_id):
    return Release(job_id)
