"""The task client's shells: the queue actor (the one serializing owner of the queue), the
TaskClient operations (submit, turn, start, reconcile, cancel) and the TurnRunner actor.

Inside a process every queue critical section is one message to the `QueueActor`; the
actor runs it in a worker thread holding the fcntl QueueLock (motor.tasks.store), so across
processes too there is exactly one read-modify-write of the queue at a time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import msgspec
import trio

import actors
from motor.client import AsyncClient, RunnerUnavailable
from motor.records import Accepted, JobRequest, Output, RefusedError, Started, Terminal, Truncated
from motor.tasks import context, core
from motor.tasks.records import (
    TERMINAL_TURN_STATES,
    ProcessIdentity,
    QueueEntry,
    RunnerRecord,
    TaskRecord,
    TurnRecord,
    atomic_write,
)
from motor.tasks.store import ClientDir, Locked, identity_of, my_identity, new_token, now_ms
from motor.tasks.workers import Fleet, WorkerSpec

T = TypeVar("T")

Spawner = Callable[[str, str, uuid.UUID], ProcessIdentity]


class _Ok:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class QueueActor(actors.Actor):
    """One message = one QueueLock critical section: `fn(locked) -> result`."""

    inbox_size = 64

    def __init__(self, cdir: ClientDir, **kw):
        super().__init__(name="task-queue", **kw)
        self.cdir = cdir

    async def handle(self, msg: Callable[[Locked], Any]) -> Any:
        try:
            return _Ok(await trio.to_thread.run_sync(self.cdir.critical, msg))
        except (core.QueueError, OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return exc  # the caller raises it; the actor keeps serving


class QueueHandle:
    """Client handle of the queue actor: `await queue.locked(fn)`."""

    def __init__(self, ref: actors.ActorRef):
        self.ref = ref

    async def locked(self, fn: Callable[[Locked], T]) -> T:
        result = await self.ref.call(fn, timeout=None)
        if isinstance(result, _Ok):
            return result.value
        raise result


async def open_queue(nursery: trio.Nursery, cdir: ClientDir) -> QueueHandle:
    await trio.to_thread.run_sync(cdir.ensure)
    return QueueHandle(await nursery.start(QueueActor(cdir).run))


# --- records helpers (called inside critical sections) -----------------------------------


def _update_turn(L: Locked, task_id: str, turn_id: str, **changes) -> TurnRecord | None:
    task = L.read_task(task_id)
    if task is None:
        return None
    for turn in task.turns:
        if turn.turn_id == turn_id:
            for k, v in changes.items():
                setattr(turn, k, v)
            L.write_task(task)
            return turn
    return None


@dataclass
class StartResult:
    outcome: str              # spawned | parked | pending | attached | failed
    detail: str = ""
    child: ProcessIdentity | None = None


def real_spawner(cdir: ClientDir) -> Spawner:
    """Start `python -m motor worker runner TASK TURN --slot-token T` in its own session."""

    def spawn(task_id: str, turn_id: str, token: uuid.UUID) -> ProcessIdentity:
        log = cdir.logs_dir / f"runner-{task_id}-{turn_id}.log"
        env = {k: v for k, v in os.environ.items() if k != "MOTOR_TASK_FAULT"}  # the hook is per process
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "motor", "worker", "runner", task_id, turn_id,
                 "--slot-token", str(token), "--client-dir", str(cdir.root)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, env=env)
        try:
            return identity_of(proc.pid)
        except Exception:
            # it already exited: report an identity that is not live
            return ProcessIdentity(pid=proc.pid, start_time_micros=0)

    return spawn


# --- critical-section bodies (one QueueLock hold each; also driven in memory by tests) ----


def complete_locked(L: Locked, task_id: str, turn_id: str, token: uuid.UUID, child: ProcessIdentity,
                    mode: str = "detached") -> bool:
    """complete_runner_spawn: adopt the child if needed and bind it on the reservation,
    publish (reservation still present), persist task.runner, clear that token, publish."""
    if not core.complete_bind(L.queue, L.observe, task_id=task_id, turn_id=turn_id, token=token, child=child):
        return False  # the child completed the handoff itself
    L.publish()                                                       # publish 1
    _fault("complete_between_publishes")
    L.set_runner(task_id, RunnerRecord(identity=child, turn_id=turn_id, mode=mode))
    core.complete_clear(L.queue, task_id=task_id, turn_id=turn_id, token=token)
    return True                                                       # publish 2 on return


def take_over_locked(L: Locked, task_id: str, turn_id: str, token: uuid.UUID, me: ProcessIdentity) -> None:
    """The detached child takes its reserved slot and finishes the handoff itself
    (idempotent with the parent's complete)."""
    core.take_over_reserved_slot(L.queue, L.runners, L.observe, task_id=task_id, turn_id=turn_id,
                                 token=token, me=me)
    L.publish()
    L.set_runner(task_id, RunnerRecord(identity=me, turn_id=turn_id))
    core.complete_clear(L.queue, task_id=task_id, turn_id=turn_id, token=token)


def reconcile_plan(L: Locked, me: ProcessIdentity, cap: int, max_parallel, new_token) -> list:
    """Reconcile under one lock hold: drop dead task.runner records; reserve for active rows
    whose runner is gone (park them when saturated); then reserve the oldest parked turns
    while slots are free, with exclude_reserver FALSE.  [(task, turn, token)] to spawn."""
    for task_id, rec in list(L.runners.items()):
        if not core.is_live(L.observe, rec.identity):
            L.set_runner(task_id, None)
    starts: list[tuple[str, str, uuid.UUID]] = []
    for row in core.fifo(L.queue):
        if not core.needs_runner(row, L.runners, L.observe):
            continue
        r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token)
        if r.acquired:
            starts.append((row.task_id, row.turn_id, r.token))
        elif r.kind == "saturated":
            core.park(L.queue, task_id=row.task_id, turn_id=row.turn_id)
            _update_turn(L, row.task_id, row.turn_id, state="parked")
    while (row := core.oldest_parked(L.queue, max_parallel, L.observe)) is not None:
        r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token)
        if not r.acquired:
            break
        starts.append((row.task_id, row.turn_id, r.token))
    return starts


def next_parked_locked(L: Locked, me: ProcessIdentity, cap: int, max_parallel, new_token,
                       finished_task: str) -> tuple[str, str] | None:
    """A finishing runner replaces its own slot (exclude_reserver TRUE) with the oldest
    parked turn, taking it over in-process; otherwise its task.runner record is cleared."""
    nxt = None
    row = core.oldest_parked(L.queue, max_parallel, L.observe)
    if row is not None:
        r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=row.task_id, turn_id=row.turn_id,
                                     reserver=me, cap=cap, new_token=new_token, exclude_reserver=True)
        if r.acquired:
            complete_locked(L, row.task_id, row.turn_id, r.token, me)
            nxt = row.key
    rec = L.runners.get(finished_task)
    if rec is not None and rec.identity == me and (nxt is None or nxt[0] != finished_task):
        L.set_runner(finished_task, None)
    return nxt


def task_facts(L: Locked, fleet: Fleet, task_id: str, turn_id: str) -> core.TaskFacts | None:
    """What a claim decision needs about one task, read under the lock (task record and its
    saved context; a context that fails its checks is one the runner cannot supply)."""
    task = L.read_task(task_id)
    if task is None:
        return None
    names = {w.name for w in fleet.capable(task.capabilities)}
    if task.pin is not None:
        names &= {task.pin}
    turn = next((t for t in task.turns if t.turn_id == turn_id), None)
    terminal = turn is None or turn.state in TERMINAL_TURN_STATES
    try:
        ctx = context.read_task_context(L.cdir.turns_dir, task_id)
        saved = str(ctx.path) if ctx is not None else None
    except context.ContextError:
        return core.TaskFacts(frozenset(names), None, None, terminal)
    worktree = os.path.realpath(task.project) if saved is None else saved
    return core.TaskFacts(frozenset(names), saved, worktree, terminal)


@dataclass
class Claimed:
    kind: str                      # keep | move | wait
    worker: str | None = None
    task_id: str | None = None     # move: the recipient
    turn_id: str | None = None
    row: QueueEntry | None = None


def claim_locked(L: Locked, fleet: Fleet, task_id: str, turn_id: str, me: ProcessIdentity,
                 observations: dict, *, reassign: bool) -> Claimed:
    """One claim of a waiting runner, one QueueLock hold (seed 001, contracts 1-5).

    keep: Waiting -> Dispatching on the chosen worker.  move: (a legacy recipient's inherited
    context written first, still under the lock) ONE queue publication: donor Waiting ->
    Parked, recipient Parked -> Waiting -> Dispatching(me, worker); then the runner metadata
    moves (recipient's task.runner = me, then the donor's cleared).  A failure after the
    publication leaves recoverable rows: the recipient's dispatch owner is this process,
    which then exits with an error; reconcile replaces it once it is dead."""
    keys = [(task_id, turn_id)] + [e.key for e in L.queue.entries if e.state in ("parked", "waiting")]
    facts = {}
    for t, u in keys:
        f = task_facts(L, fleet, t, u)
        if f is not None:
            facts.setdefault(t, f)
    c = core.claim_parked_for_waiting_runner(
        L.queue, task_id=task_id, turn_id=turn_id, owner=me, observations=observations, facts=facts,
        max_parallel=fleet.max_parallel, reassign=reassign, observe=L.observe)
    if c.kind == "wait":
        return Claimed("wait")
    if c.kind == "keep":
        r = core.begin_dispatch(L.queue, task_id=task_id, turn_id=turn_id, me=me, worker=c.worker)
        _update_turn(L, task_id, turn_id, state="dispatching", worker=c.worker)
        return Claimed("keep", c.worker, task_id, turn_id, core.msgspec_copy(r))
    rt, ru = c.recipient
    if c.inherit:  # contract 4: the inherited context is durable before the queue moves
        donor_task = L.read_task(task_id)
        src = context.task_project_path(L.cdir.turns_dir, task_id, donor_task.project)
        context.write_task_project_path(L.cdir.turns_dir, rt, L.read_task(rt).project, src)
    r = core.apply_reassignment(L.queue, donor=(task_id, turn_id), recipient=(rt, ru), owner=me, worker=c.worker)
    row = core.msgspec_copy(r)
    L.publish()                                                      # the one queue publication
    _update_turn(L, task_id, turn_id, state="parked", detail=f"donated its runner process to task {rt}")
    _update_turn(L, rt, ru, state="dispatching", worker=c.worker, donated_from=task_id, detail=None)
    _fault("reassign_after_publish")
    L.set_runner(rt, RunnerRecord(identity=me, turn_id=ru))
    _fault("reassign_between_metadata")
    rec = L.runners.get(task_id)
    if rec is not None and rec.identity == me:
        L.set_runner(task_id, None)
    return Claimed("move", c.worker, rt, ru, row)


class TaskClient:
    """The task client's operations on one client dir, for one process (`me`)."""

    def __init__(self, cdir: ClientDir, queue: QueueHandle, fleet: Fleet, *,
                 me: ProcessIdentity | None = None, spawner: Spawner | None = None,
                 token_source: Callable[[], uuid.UUID] = new_token, clock: Callable[[], int] = now_ms):
        self.cdir = cdir
        self.queue = queue
        self.fleet = fleet
        self.me = me or my_identity()
        self.spawner = spawner or real_spawner(cdir)
        self.new_token = token_source
        self.clock = clock
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

        def fn(L: Locked):
            # rollback-protected submission: the owner-only context, then the record, then
            # the row; a failure removes what was written (context directory included)
            try:
                context.write_task_project_path(L.cdir.turns_dir, task_id, project, Path(project))
                _fault("submit_after_context")
                L.write_task(task)  # the record exists before its row: no row without a task
                core.enqueue(L.queue, task_id=task_id, turn_id="1", owner=me, now_ms=now, pin=pin, run=run,
                             attached=attached)
            except BaseException:
                core.drop_rows(L.queue, task_id)
                L.cdir.task_path(task_id).unlink(missing_ok=True)
                context.remove_task_context(L.cdir.turns_dir, task_id)
                raise

        await self.queue.locked(fn)
        return task_id, "1"

    async def add_turn(self, task_id: str, command: list[str]) -> str:
        now = self.clock()
        me = self.me

        def fn(L: Locked):
            task = L.read_task(task_id)
            if task is None:
                raise core.QueueError("TASK_UNKNOWN", f"no task {task_id}")
            if any(row.task_id == task_id and row.cancel_requested for row in L.queue.entries):
                raise core.QueueError("TASK_CANCELLING", f"task {task_id} is being cancelled")
            turn_id = str(len(task.turns) + 1)
            task.turns.append(TurnRecord(turn_id=turn_id, command=command, submitted_at_ms=now))
            L.write_task(task)
            core.enqueue(L.queue, task_id=task_id, turn_id=turn_id, owner=me, now_ms=now,
                         pin=task.pin, run=task.run)
            return turn_id

        return await self.queue.locked(fn)

    # -- starting runners ---------------------------------------------------------------

    async def start_turn(self, task_id: str, turn_id: str) -> StartResult:
        """Submit's start: reserve; Acquired -> spawn outside the lock and hand off;
        Saturated (or not eligible yet) -> park; Pending -> someone else has it."""
        me, cap, mp = self.me, self.cap, self.fleet.max_parallel

        def reserve(L: Locked):
            row = core.require_row(L.queue, task_id, turn_id)
            if not core.eligible(L.queue, row, mp):
                core.park(L.queue, task_id=task_id, turn_id=turn_id)
                _update_turn(L, task_id, turn_id, state="parked")
                return core.Reserve("saturated", 0)
            r = core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=task_id, turn_id=turn_id,
                                         reserver=me, cap=cap, new_token=self.new_token)
            if r.kind == "saturated":
                core.park(L.queue, task_id=task_id, turn_id=turn_id)
                _update_turn(L, task_id, turn_id, state="parked")
            return r

        r = await self.queue.locked(reserve)
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
            lambda L: complete_locked(L, task_id, turn_id, token, child, mode))

    async def release(self, task_id: str, turn_id: str, token: uuid.UUID) -> bool:
        me = self.me
        return await self.queue.locked(lambda L: core.release_runner_slot(
            L.queue, task_id=task_id, turn_id=turn_id, token=token, reserver=me))

    async def reconcile(self) -> list[StartResult]:
        """Replace dead runners of active turns, then start the oldest parked turns while
        slots are free (exclude_reserver false: the reconciler's own slot counts)."""
        me, cap, mp = self.me, self.cap, self.fleet.max_parallel

        starts = await self.queue.locked(lambda L: reconcile_plan(L, me, cap, mp, self.new_token))
        return [await self.spawn_and_hand_off(t, u, tok) for t, u, tok in starts]

    async def cancel(self, task_id: str) -> list[tuple[str, str]]:
        """Queued turns of the task leave the queue as cancelled; a dispatched one is marked
        and its runner job cancelled on its worker.  Returns [(worker, job_id)] to cancel."""
        now = self.clock()

        def fn(L: Locked):
            task = L.read_task(task_id)
            if task is None:
                raise core.QueueError("TASK_UNKNOWN", f"no task {task_id}")
            remote = []
            for row in list(L.queue.entries):
                if row.task_id != task_id:
                    continue
                if row.worker and row.job_id:
                    remote.append((row.worker, row.job_id))
                holder = core.acting_queue_holder(row)
                res = row.slot_reservation
                if (core.is_live(L.observe, holder) or (res is not None and (
                        core.is_live(L.observe, res.reserver) or core.is_live(L.observe, res.child)))):
                    row.cancel_requested = True   # its live runner ends the turn as cancelled
                else:
                    L.queue.entries.remove(row)
                    for turn in task.turns:
                        if turn.turn_id == row.turn_id:
                            turn.state = "cancelled"
                            turn.ended_at_ms = now
                            turn.reason = "cancelled"
            L.write_task(task)
            return remote

        remote = await self.queue.locked(fn)
        for worker, job_id in remote:
            spec = self.fleet.get(worker)
            if spec is None:
                continue
            try:
                async with worker_client(spec) as client:
                    await client.cancel(job_id)
            except (RefusedError, RunnerUnavailable):
                pass
        return remote


def _fault(point: str) -> None:
    """Fault injection for tests: MOTOR_TASK_FAULT=<point> kills this process there;
    MOTOR_TASK_FAULT=<point>:raise makes the step fail with an OSError instead."""
    value = os.environ.get("MOTOR_TASK_FAULT")
    if value == point:
        os._exit(86)
    if value == f"{point}:raise":
        raise OSError(f"fault injected at {point}")


def worker_client(spec: WorkerSpec, timeout: float = 30.0) -> AsyncClient:
    return AsyncClient.for_endpoint(spec.endpoint, token=spec.token(), timeout=timeout)


async def probe_health(spec: WorkerSpec, timeout: float = 5.0) -> dict | str:
    """The worker's health report, or the error text when it does not answer."""
    try:
        with trio.fail_after(timeout):
            async with worker_client(spec, timeout=timeout) as client:
                return await client.health()
    except trio.TooSlowError:
        return f"no answer within {timeout:g} s"
    except (RunnerUnavailable, RefusedError, OSError) as exc:
        return str(exc)


def make_bundle(project: Path, dest_dir: Path) -> tuple[Path, str]:
    """A tar of the project's worktree (without `.git`), and its sha256."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"bundle-{os.getpid()}-{uuid.uuid4().hex[:8]}.tar"

    def skip_git(info: tarfile.TarInfo):
        parts = info.name.split("/")
        if ".git" in parts:
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for entry in sorted(os.listdir(project)):
            if entry == ".git":
                continue
            tf.add(project / entry, arcname=entry, filter=skip_git)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return path, digest.hexdigest()


class TurnRunner(actors.Actor):
    """Runs one turn: chooses a worker, dispatches the turn as a runner job (bundle of the
    project worktree, workspace named for the task), streams its output into
    C/turns/<task>/<turn>/, imports the terminal record, and removes the row.

    `result` is the turn's final TurnRecord (or None when the turn went back to the queue,
    e.g. no worker answered).  `echo`: write the output to our stdout/stderr too (attached)."""

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

    async def _run(self) -> TurnRecord | None:
        tc, me = self.tc, self.tc.me
        task = await trio.to_thread.run_sync(tc.cdir.read_task, self.task_id)
        if task is None:
            return None
        row = await tc.queue.locked(lambda L: core.find_row(L.queue, self.task_id, self.turn_id))
        if row is None:
            return None
        if row.cancel_requested and not row.job_id:
            return await self._finish(dict(state="cancelled", reason="cancelled"))
        if self.wait_for_worker and row.state == "waiting" and row.owner == me and not row.job_id:
            claimed = await self._claim(task, row)
            if claimed is None:
                return None
            if claimed == "cancelled":
                return await self._finish(dict(state="cancelled", reason="cancelled"))
            if claimed.kind == "move":  # this process now runs the recipient's turn
                self.donations.append((self.task_id, claimed.task_id))
                self.task_id, self.turn_id = claimed.task_id, claimed.turn_id
                task = await trio.to_thread.run_sync(tc.cdir.read_task, self.task_id)
            row = claimed.row
        else:
            row = await self._dispatch_now(task, row)
            if row is None:
                return None
        return await self._execute(task, row)

    def _own_candidates(self, task: TaskRecord, row: QueueEntry) -> list[WorkerSpec]:
        tc = self.tc
        candidates = [tc.fleet.get(row.worker)] if row.worker else (
            [tc.fleet.get(task.pin)] if task.pin else list(tc.fleet.workers))
        return [c for c in candidates if c is not None and set(task.capabilities) <= set(c.capabilities)]

    async def _observe(self, specs: list[WorkerSpec], reports: dict, errors: list) -> None:
        async with trio.open_nursery() as n:
            async def probe(spec: WorkerSpec):
                rep = await probe_health(spec, timeout=15.0)
                if isinstance(rep, dict):
                    reports[spec.name] = rep
                else:
                    errors.append(f"worker {spec.name} unreachable at {spec.endpoint}: {rep}")
            for spec in specs:
                n.start_soon(probe, spec)

    async def _park_unreachable(self, errors: list) -> None:
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        detail = "; ".join(sorted(errors)) or "no worker is configured for this turn"

        def back(L: Locked):
            r = core.find_row(L.queue, task_id, turn_id)
            if r is not None and me in (r.owner, r.dispatch_owner):
                core.park(L.queue, task_id=task_id, turn_id=turn_id)
                _update_turn(L, task_id, turn_id, state="parked", detail=detail)

        await tc.queue.locked(back)
        if self.echo:
            sys.stderr.write(f"motor: {detail}; the turn stays queued\n")

    async def _dispatch_now(self, task: TaskRecord, row: QueueEntry) -> QueueEntry | None:
        """Attached execution and re-attach: dispatch to the best answering worker at once
        (the worker queues the job when it is busy)."""
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        reports: dict = {}
        errors: list = []
        await self._observe(self._own_candidates(task, row), reports, errors)
        if not reports:
            await self._park_unreachable(errors)
            return None

        def dispatch(L: Locked):
            r = core.require_row(L.queue, task_id, turn_id)
            worker = r.worker if r.worker in reports else core.pick_worker(L.queue, reports)
            r = core.begin_dispatch(L.queue, task_id=task_id, turn_id=turn_id, me=me, worker=worker)
            _update_turn(L, task_id, turn_id, state="dispatching", worker=worker)
            return core.msgspec_copy(r)

        return await tc.queue.locked(dispatch)

    async def _claim(self, task: TaskRecord, row: QueueEntry):
        """The detached runner's wait (seed 001, contract 2): observe its own worker(s); claim
        under the lock (keep -> dispatch); after a miss, and only when parked work exists,
        observe the rest of the fleet (keeping this iteration's observations) and claim
        again, which may donate this process to a parked turn.  Otherwise wait a poll
        interval and start a new iteration.  None: parked (no worker answers) or gone."""
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        fleet = tc.fleet
        while True:
            reports: dict = {}
            errors: list = []
            own = self._own_candidates(task, row)
            await self._observe(own, reports, errors)
            if not reports:
                await self._park_unreachable(errors)
                return None
            claimed = await tc.queue.locked(
                lambda L: claim_locked(L, fleet, task_id, turn_id, me, dict(reports), reassign=self.reassign))
            if claimed.kind != "wait":
                return claimed
            snapshot = await tc.queue.locked(lambda L: core.msgspec_copy(core.require_row(L.queue, task_id, turn_id))
                                             if core.find_row(L.queue, task_id, turn_id) else None)
            if snapshot is None or snapshot.state != "waiting" or snapshot.owner != me:
                return None
            if snapshot.cancel_requested:
                return "cancelled"
            parked = await tc.queue.locked(lambda L: any(e.state == "parked" for e in L.queue.entries))
            rest = [w for w in fleet.workers if w.name not in reports and w not in own]
            if self.reassign and parked and rest:
                await self._observe(rest, reports, errors)
                claimed = await tc.queue.locked(
                    lambda L: claim_locked(L, fleet, task_id, turn_id, me, dict(reports), reassign=True))
                if claimed.kind != "wait":
                    return claimed
            await trio.sleep(tc.poll_interval)

    async def _execute(self, task: TaskRecord, row: QueueEntry) -> TurnRecord | None:
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        spec = tc.fleet.get(row.worker)
        assert spec is not None
        out_dir = tc.cdir.turn_dir(task_id, turn_id)
        await trio.to_thread.run_sync(lambda: out_dir.mkdir(parents=True, exist_ok=True))
        try:
            async with worker_client(spec) as client:
                job_id = row.job_id or await self._find_orphan_job(client, task)
                if job_id is not None:
                    stream = await client.events(job_id, 0)
                else:
                    stream = await self._submit(client, task, row, out_dir)
                terminal = await self._follow(stream, out_dir, client)
        except RefusedError as exc:
            return await self._finish(dict(state="refused", reason=exc.refusal.code, detail=exc.refusal.detail))
        except context.ContextError as exc:  # a redirected/mismatched saved worktree: never run elsewhere
            return await self._finish(dict(state="refused", reason=exc.code, detail=exc.detail))
        except RunnerUnavailable as exc:
            detail = f"worker {spec.name} unreachable at {spec.endpoint}: {exc}"

            def back(L: Locked):
                r = core.find_row(L.queue, task_id, turn_id)
                if r is not None and r.dispatch_owner == me:
                    core.park(L.queue, task_id=task_id, turn_id=turn_id)
                    _update_turn(L, task_id, turn_id, state="parked", detail=detail)

            await tc.queue.locked(back)
            return None
        if terminal is None:
            return await self._finish(dict(state="lost", reason="stream_ended",
                                           detail="the worker closed the stream before the job ended"))
        rec = terminal.record
        await trio.to_thread.run_sync(atomic_write, out_dir / "record.json", msgspec.json.encode(rec) + b"\n")
        state = {"succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled",
                 "timed_out": "timed_out", "refused_before_start": "refused", "lost": "lost"}.get(
            rec.get("state"), "failed")
        return await self._finish(dict(state=state, exit_code=rec.get("exit_code"), signal=rec.get("signal"),
                                       reason=rec.get("reason"), detail=rec.get("detail"),
                                       job_id=rec.get("job_id")))

    async def _find_orphan_job(self, client: AsyncClient, task: TaskRecord) -> str | None:
        """A turn dispatched by a runner that died before recording the job id: the job in
        the task's workspace that no earlier turn owns is this turn's."""
        row = await self.tc.queue.locked(lambda L: core.find_row(L.queue, self.task_id, self.turn_id))
        if row is None or row.worker is None:
            return None
        known = {t.job_id for t in task.turns if t.job_id}
        turn = next((t for t in task.turns if t.turn_id == self.turn_id), None)
        if turn is None or turn.state not in ("dispatching", "running", "parked"):
            return None
        jobs = await client.jobs(all=True)
        mine = [j for j in jobs if j.workspace == task.workspace and j.job_id not in known
                and j.env.get("MOTOR_TURN", self.turn_id) == self.turn_id]
        return max(mine, key=lambda j: j.accepted_at_ms).job_id if mine else None

    async def _submit(self, client: AsyncClient, task: TaskRecord, row: QueueEntry, out_dir: Path):
        project = await trio.to_thread.run_sync(resolve_project, self.tc.cdir, task)
        bundle, sha = await trio.to_thread.run_sync(make_bundle, project, self.tc.cdir.root / "bundles")
        try:
            await client.put_bundle(sha, bundle)
        finally:
            await trio.to_thread.run_sync(lambda: bundle.unlink(missing_ok=True))
        turn = next(t for t in task.turns if t.turn_id == self.turn_id)
        req = JobRequest(command=turn.command, workspace=task.workspace, bundle_sha256=sha,
                         env={"MOTOR_TASK": task.task_id, "MOTOR_TURN": self.turn_id})
        return await client.submit(req, follow=True)

    async def _follow(self, stream, out_dir: Path, client: AsyncClient) -> Terminal | None:
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        terminal = None
        with open(out_dir / "output.log", "wb") as out, open(out_dir / "events.jsonl", "wb") as evlog:
            async with stream:
                async for event in stream:
                    evlog.write(msgspec.json.encode(event) + b"\n")
                    evlog.flush()
                    if isinstance(event, Accepted):
                        job_id = event.job_id

                        def record_job(L: Locked, job_id=job_id):
                            r = core.find_row(L.queue, task_id, turn_id)
                            if r is not None and r.dispatch_owner == me:
                                r.job_id = job_id
                                _update_turn(L, task_id, turn_id, job_id=job_id)
                            return r is not None and r.cancel_requested

                        if await tc.queue.locked(record_job):
                            await client.cancel(job_id)
                    elif isinstance(event, Started):
                        now = tc.clock()
                        await tc.queue.locked(lambda L: _update_turn(L, task_id, turn_id, state="running",
                                                                     started_at_ms=now))
                    elif isinstance(event, Output):
                        data = event.data.encode("utf-8", "surrogateescape")
                        out.write(data)
                        out.flush()
                        if self.echo:
                            target = sys.stderr if event.stream == "stderr" else sys.stdout
                            target.buffer.write(data)
                            target.buffer.flush()
                    elif isinstance(event, Truncated):
                        out.write(b"[motor: earlier output is no longer retained]\n")
                    elif isinstance(event, Terminal):
                        terminal = event
                        break
        return terminal

    async def _finish(self, changes: dict) -> TurnRecord | None:
        tc, task_id, turn_id, me = self.tc, self.task_id, self.turn_id, self.tc.me
        now = tc.clock()

        def fn(L: Locked):
            row = core.find_row(L.queue, task_id, turn_id)
            if row is not None:
                core.finish_turn(L.queue, task_id=task_id, turn_id=turn_id, me=me)
            return _update_turn(L, task_id, turn_id, ended_at_ms=now,
                                **{k: v for k, v in changes.items() if v is not None or k == "exit_code"})

        return await tc.queue.locked(fn)


def resolve_project(cdir: ClientDir, task: TaskRecord) -> Path:
    """The worktree a turn executes (seed 001, contract 7): the task's saved context when it
    has one (checked: rooted, canonical, bound to this task and project), whatever the
    runner's cwd; a legacy task without one keeps its record's project path (relative to the
    current directory only if it was recorded relative)."""
    saved = context.task_project_path(cdir.turns_dir, task.task_id, task.project)
    return saved if saved is not None else Path(task.project)


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
    await tc.queue.locked(lambda L: take_over_locked(L, task_id, turn_id, token, me))


async def start_next_parked(tc: TaskClient, finished_task: str) -> tuple[str, str] | None:
    """A finishing runner replaces its own slot: reserve the oldest parked turn with
    exclude_reserver TRUE and, when acquired, take it over in this same process (no new
    process: the count of runner processes never exceeds the cap, even for an instant)."""
    me, cap, mp = tc.me, tc.cap, tc.fleet.max_parallel
    return await tc.queue.locked(lambda L: next_parked_locked(L, me, cap, mp, tc.new_token, finished_task))


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


async def retire(tc: TaskClient, task_id: str) -> None:
    """Clear task.runner when it is still us."""
    me = tc.me

    def fn(L: Locked):
        rec = L.runners.get(task_id)
        if rec is not None and rec.identity == me:
            L.set_runner(task_id, None)

    await tc.queue.locked(fn)


__all__ = ["QueueActor", "QueueHandle", "open_queue", "TaskClient", "TurnRunner", "StartResult",
           "run_turn", "detached_runner", "start_next_parked", "take_over_reserved_slot", "real_spawner",
           "make_bundle", "probe_health", "retire", "complete_locked", "take_over_locked",
           "reconcile_plan", "next_parked_locked", "claim_locked", "task_facts", "Claimed", "host_turn",
           "resolve_project"]
