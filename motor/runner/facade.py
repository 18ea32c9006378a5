"""The `Runner` facade: the embedding API over the supervisor tree (motor/runner/tree.py
builds the tree and hands the facade its root)."""

from __future__ import annotations

import contextlib
import errno
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
import trio

import actors

from .. import logsink
from ..config import RunnerConfig
from ..disk.bundles import BundleError, valid_sha
from ..disk.core import admission, inode_floors
from ..execution.spawner import SPAWN_STALLED_S, SPAWN_TIMEOUT_S
from ..lifecycle import QUEUED, history_expired
from ..records import (
    CAPABILITIES, Event, JobRecord, JobRequest, Refusal, RefusedError, TERMINAL_STATES,
    Truncated, decode_event, public_record, to_json,
)
from ..scheduling.admission import withdraw_answer
from ..scheduling.view import join_array, row_of
from ..store.checkpoints import WAL_SIZE_LIMIT, wal_stuck
from ..store.hub import ChangeHub
from ..store.pace import STALLED_COMMIT_S
from ..store.salvage import tell_once
from .host import Host
from ..wire import MAX_BATCH_JOBS

if TYPE_CHECKING:
    from .tree import Handles

#: This many failed job starts in a row, none succeeding between, and the health report says
#: so (`execution`): a runner whose every start fails (its isolation groups refused, keeperd
#: unable to spawn) otherwise looked healthy while its queue never moved.
FAILED_STARTS_DEGRADED = 3


def _stored_event(raw: bytes, job_id: str) -> Event | None:
    """A stored event, or None when this version cannot read it (an event type of a later
    motor, a damaged row): skipped, and said once per job in the log, rather than ending
    the replay of the whole job with msgspec's error (stop 48; operations.md, "A record the
    runner cannot read")."""
    try:
        return decode_event(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        tell_once(("event", job_id), "job %s: a stored event this runner cannot read was "
                  "skipped (%s)", job_id, exc)
        return None


@contextlib.contextmanager
def _queued_when_busy(what: str, then: str):
    """A cancel or withdraw the dispatcher did not answer within its bound (busy: a save
    waiting on a slow disk or another process's lock) stays in its inbox and is carried
    out once it is free: answered 503 `runner_busy` saying so (stop 52; before, the answer
    did not say so, and the client's bound was the same 30 s: `motor cancel` got that 503
    or exited 69, "no runner answered: timed out", whichever came first, and the job was
    cancelled later all the same)."""
    try:
        yield
    except actors.CallTimeout as exc:
        raise RefusedError(Refusal(code="runner_busy", detail=(
            f"the dispatcher did not answer in time ({exc}): this {what} waits in its queue "
            f"and is carried out once it is free ({then}); `motor health` says what it "
            "waits for (e.g. the job database, on a slow disk or another process's lock)")))


class Runner:
    """The embedding API: the same actors `serve` runs, called from Python.

    It speaks to the subsystems through their typed handles (motor/handles.py, made by
    motor/runner/tree.py before the tree starts), never by building their messages."""

    capabilities = CAPABILITIES

    def __init__(self, config: RunnerConfig, root: actors.Supervisor, db, hub: ChangeHub,
                 host: Host, clock, *, handles: Handles, followers: set[str] | None = None,
                 spawner: Any = None):
        self.config = config
        #: the jobs' keeper client: how long its oldest spawn in flight has waited (health)
        self.spawner = spawner
        self.root = root
        self.db = db
        self.hub = hub
        self.host = host
        self.clock = clock
        #: every subsystem's ref and typed handle (tree.py's `Handles`)
        self.handles = handles
        #: ids of jobs a client follows now (the dispatcher reads it when it recovers)
        self.followers: set[str] = set() if followers is None else followers

    # -- refs -----------------------------------------------------------------------------

    def actor(self, name: str) -> actors.ActorRef:
        """A subsystem actor's ref (stable across its restarts), for tests and introspection."""
        return self.handles.refs[name]

    @property
    def dispatcher(self) -> actors.ActorRef:
        return self.handles.dispatcher.ref

    # -- jobs -----------------------------------------------------------------------------

    async def submit(self, req: JobRequest | dict, *, follow: bool = False) -> JobRecord:
        """Submit one job: a `JobRequest`, or a dict of its fields (as `motor.client` takes
        one), checked as the API checks a body (`records.validate_request`)."""
        if isinstance(req, dict):
            try:
                req = msgspec.convert(req, JobRequest)
            except msgspec.ValidationError as exc:
                raise RefusedError(Refusal(code="bad_request", detail=f"malformed request: {exc}"))
        try:
            reply = await self.handles.dispatcher.submit(req, follow)
        except actors.CallTimeout as exc:  # its acceptance may still be written after this
            raise RefusedError(Refusal(code="submit_unconfirmed", detail=(
                f"the runner did not confirm this submit within {exc.timeout:g} s (`motor "
                "health` says what it waits for: e.g. the job database, on a slow disk or on "
                "another process's lock); it may still be accepted: look for it in `motor "
                "jobs` before submitting it again"))) from None
        if isinstance(reply, Refusal):
            raise RefusedError(reply)
        return reply

    async def submit_many(self, reqs: list[JobRequest | dict]) -> list[JobRecord | Refusal]:
        """A batch submit: each request is one `Submit` to the dispatcher, in order, with the
        same admission as `submit`; the answer per item is its accepted record or its
        refusal, so one refused item does not sink the others. More than MAX_BATCH_JOBS
        requests: RefusedError `batch_too_large` and nothing is submitted."""
        if len(reqs) > MAX_BATCH_JOBS:
            raise RefusedError(Refusal(code="batch_too_large", detail=(
                f"a batch submit carries at most {MAX_BATCH_JOBS} jobs, got {len(reqs)}")))
        answers: list[JobRecord | Refusal] = []
        for req in reqs:
            try:
                answers.append(await self.submit(req))
            except RefusedError as exc:
                answers.append(exc.refusal)
        return answers

    async def get(self, job_id: str) -> JobRecord:
        [record] = await self._live([self._known(job_id)])
        return record

    async def _live(self, records: list[JobRecord]) -> list[JobRecord]:
        """`records`, each queued one with its live wait fields (queue_wait_ms, waiting_on,
        waiting_on_job, waiting_detail) as the dispatcher has them now: one call for all;
        the records are copied here, not in the dispatcher, which serializes scheduling."""
        queued = tuple(r.job_id for r in records if r.state == QUEUED)
        if not queued:
            return records
        live = await self.handles.dispatcher.queued_views(queued)
        replace = msgspec.structs.replace
        return [r if (w := live.get(r.job_id)) is None else
                replace(r, waiting_on=w[0], waiting_on_job=w[1], queue_wait_ms=w[2],
                        waiting_detail=w[3]) for r in records]

    def _missing(self, job_id: str) -> Refusal:
        if history_expired(job_id, self.clock.now_ms()):
            return Refusal(code="history_expired",
                           detail=f"job {job_id} is older than the 24 h retention")
        return Refusal(code="not_found", detail=f"no job {job_id} on this runner")

    async def jobs(self, *, all: bool = False) -> list[JobRecord]:
        """The stored records, newest first; a queued one as `get` shows it (its live
        queue_wait_ms and waiting_on), not as last saved."""
        return await self._live(self.db.listing(limit=10_000 if all else 200))

    async def events(self, job_id: str, from_seq: int = 0) -> AsyncIterator[Event]:
        """Replay stored events from `from_seq`, then follow until the terminal event.

        While the job is queued, a `queued` heartbeat with the live queue_wait_ms and
        waiting_on is yielded every heartbeat interval; heartbeats are not stored and
        repeat the seq of the latest stored event.
        """
        record = self._known(job_id)
        next_seq = max(from_seq, 0)
        last_seq = 0
        # Events committed from here on are kept in the hub for this follower: once it has
        # read the database to its end (`synced`), it takes the next ones from there, not
        # from the database after every commit (issue 14).
        self.hub.follow(job_id)
        synced = False
        try:
            while True:
                changed = self.hub.changed(job_id)
                rows = self.hub.recent(job_id, next_seq) if synced else None
                from_db = rows is None
                if from_db:  # not (all) in the hub: read the database
                    synced = False
                    truncated = self.db.truncated_before(job_id)
                    if next_seq < truncated:  # evicted pages: say so, never skip silently
                        # The boundary comes first (seq just before what is replayed, so seqs
                        # stay ordered), then the lifecycle events pages never evict, the rest.
                        yield Truncated(seq=max(next_seq - 1, 0), truncated_before_seq=truncated)
                        kept = [e for raw in self.db.events_from(
                            job_id, next_seq, limit=truncated - next_seq)
                            if (e := _stored_event(raw, job_id)) is not None]
                        for event in (e for e in kept if e.seq < truncated):
                            yield event
                            last_seq = event.seq
                            if event.__struct_config__.tag == "terminal":
                                return
                        next_seq = truncated
                    rows = self.db.events_from(job_id, next_seq)
                for raw in rows:
                    event = _stored_event(raw, job_id) if from_db else decode_event(raw)
                    if event is None:  # skipped (logged): the rows' seqs follow one another
                        next_seq += 1
                        continue
                    yield event
                    next_seq = last_seq = event.seq
                    next_seq += 1
                    if event.__struct_config__.tag == "terminal":
                        return
                if rows:
                    continue
                if from_db:
                    record = self._known(job_id)
                    if record.state in TERMINAL_STATES and not self.db.events_from(job_id, next_seq):
                        return
                    synced = True
                with trio.move_on_after(self.config.heartbeat_s):
                    await changed.wait()
                    continue
                if not from_db:  # a heartbeat is due: is the job still queued?
                    record = self._known(job_id)
                if record.state == QUEUED:
                    try:
                        beat = await self.handles.dispatcher.heartbeat(job_id)
                    except actors.ActorDead:  # restarting: the next beat comes from its successor
                        beat = None
                    if beat is not None:
                        beat.seq = last_seq
                        yield beat
        finally:
            self.hub.unfollow(job_id)

    def _known(self, job_id: str) -> JobRecord:
        """The job's record; RefusedError not_found when the runner has none."""
        record = self.db.get(job_id)
        if record is None:
            raise RefusedError(self._missing(job_id))
        return record

    async def follow(self, job_id: str) -> AsyncIterator[Event]:
        """`events(job_id)` for the client that submitted the job and follows it.

        While it follows, that client enforces the job's queue-wait budget (it withdraws
        the job when its local deadline passes). If it goes away before the job ends, the
        runner takes over enforcing the budget with the same rule.
        """
        ended = False
        self.followers.add(job_id)
        try:
            # closed here when this stream is (its client gone), not left to the collector
            async with contextlib.aclosing(self.events(job_id, 0)) as events:
                async for event in events:
                    if event.__struct_config__.tag == "terminal":
                        ended = True
                    yield event
        finally:
            self.followers.discard(job_id)
            if not ended:
                with trio.CancelScope(shield=True):
                    try:
                        await self.handles.dispatcher.unfollowed(job_id)
                    except actors.ActorDead:
                        pass

    async def cancel(self, job_id: str) -> JobRecord:
        await self.get(job_id)
        with _queued_when_busy("cancel", "the job ends cancelled"):
            await self.handles.dispatcher.cancel(job_id)
        return await self.get(job_id)

    async def withdraw(self, job_id: str) -> str:
        await self.get(job_id)
        with _queued_when_busy("withdraw", "the job is withdrawn if it has not started"):
            answer = await self.handles.dispatcher.withdraw(job_id)
        if answer == "unknown":  # it ended meanwhile: answer what happened
            answer = withdraw_answer(self.db.get(job_id))
        if isinstance(answer, Refusal):
            raise RefusedError(answer)  # already_ended, naming the state: never "withdrawn"
        return answer

    # -- reports --------------------------------------------------------------------------

    async def status(self, full: bool = False) -> dict:
        """The live view: a status row of each queued and running job (scheduling/view.py
        ROW_FIELDS), or with `full` its whole public record, and the capacity."""
        view = await self.handles.dispatcher.status_view(full=full)
        view["running"] = self._running(view.pop("active"), full)
        return view

    async def status_json(self, full: bool = False) -> bytes:
        """`status()` as the JSON bytes `GET /v1/status` answers (with a final newline),
        its queued rows spliced from the dispatcher's encoded view (issue 14)."""
        view = await self.handles.dispatcher.status_view(encoded=True, full=full)
        return join_array(view["queued"], b'{"queued":',
                          b',"running":' + to_json(self._running(view["active"], full))
                          + b',"capacity":' + to_json(view["capacity"]) + b"}\n")

    def _running(self, active: list[str], full: bool) -> list[dict]:
        records = [r for r in map(self.db.get, active) if r is not None]
        if full:
            return [public_record(r) for r in records]
        return [row_of(r) for r in records]

    async def health(self) -> dict:
        """The health report. `status` is "ok", or "degraded" with `degraded` listing each
        subsystem in trouble and why: a write refused for lack of space, recent crashes
        (restarts counted against its supervisor's budget), or a part that did not answer.
        A part that does not answer is left out; the probe itself never fails for it."""
        degraded: list[dict] = []
        h = self.handles

        async def ask(name: str, question, *args, timeout: float = 10):
            try:
                with trio.fail_after(timeout):
                    return await question(*args)
            except trio.TooSlowError:
                degraded.append({"subsystem": name,
                                 "cause": f"did not answer within {timeout:g} s"})
            except actors.ActorDead as exc:  # between two incarnations: its supervisor's
                degraded.append({"subsystem": name, "cause": f"did not answer: {exc!r}",
                                 "dead": True})  # report of the crash says why (below)
            except Exception as exc:  # noqa: BLE001 - reported, never raised to the probe
                degraded.append({"subsystem": name, "cause": f"did not answer: {exc!r}"})
            return None

        capacity = await ask("dispatcher", h.dispatcher.capacity)  # O(1): no per-job view
        disk = await ask("disk", h.disk.sample)
        cpus = await ask("cpu", h.cpu.snapshot)
        ledger = await ask("accounting", h.accounting.report, self.clock.now_ms())
        if ledger is None:  # optional figures: a stuck accounting actor never fails a probe
            ledger = {"admission_refusals": {}, "finished": {}, "underused": [],
                      "repositories": {}, "queue_wait_hourly": [], "accounting_unavailable": True}
        report: dict[str, Any] = {"isolation": self.host.backend.health()}
        if capacity is not None:
            report["capacity"] = capacity
        if cpus is not None:
            report["cpus"] = {"online": cpus["online"], "allowed": cpus["allowed"],
                              "kept_back": cpus["kept_back"], "jobs": cpus["jobs"]}
        if disk is not None:
            report["disk"] = {"free_bytes": disk.free_bytes, "total_bytes": disk.total_bytes,
                              "floor_bytes": self.config.floor_bytes(),
                              "goal_bytes": self.config.goal_bytes()}
            if disk.total_inodes:  # a file system that counts its inodes (disk.md, "Inodes")
                floor, goal = inode_floors(disk, self.config.floor_bytes())
                report["disk"].update(free_inodes=disk.free_inodes, total_inodes=disk.total_inodes,
                                      floor_inodes=floor, goal_inodes=goal)
            if self.host.state_fs is not None:
                report["disk"]["state_filesystem"] = self.host.state_fs
            degraded += [{"subsystem": "disk", "cause": cause} for cause in disk.problems]
            if (short := admission(disk, self.config.floor_bytes())) is not None:
                degraded.append({"subsystem": "disk", "cause": (  # (stop 58: it said ok)
                    f"{short.detail}: jobs are refused runner_disk_full until the cleanup "
                    "or an operator frees space")})
        report.update(ledger)
        if capacity is not None and capacity.get("failed_starts", 0) >= FAILED_STARTS_DEGRADED:
            degraded.append({"subsystem": "execution", "cause": (
                f"the last {capacity['failed_starts']} job starts failed and none has "
                f"succeeded since (the latest: {capacity['last_start_failure']['detail']}); "
                "each is retried, at most 60 s apart")})
        waits = getattr(self.spawner, "waits", None)  # (a test's fake spawner has none)
        waited = 0.0 if waits is None else waits.longest_s(trio.current_time())
        if waited >= SPAWN_STALLED_S:
            degraded.append({"subsystem": "execution", "cause": (
                f"a job's spawn has waited {waited:.1f} s for the jobs' keeper process "
                f"({self.spawner.keeper_process}): jobs wait in set-up until it answers; "
                f"after {SPAWN_TIMEOUT_S:g} s a start fails and is retried")})
        troubles = self._supervision_troubles()
        restarting = {t["subsystem"] for t in troubles}
        degraded = troubles + [d for d in degraded if not (d.pop("dead", False)
                                                           and d["subsystem"] in restarting)]
        db = self.db
        if db.checkpoint_error is not None:
            degraded.insert(0, {"subsystem": "store", "cause": db.checkpoint_error
                                + "; the WAL grows until a checkpoint succeeds"})
        if db.full_error is not None:
            degraded.insert(0, {"subsystem": "store", "cause": db.full_error})
        if wal_stuck(wal := db.wal_bytes(), db.last_checkpoint):
            degraded.insert(0, {"subsystem": "store", "cause": (
                f"the WAL ({db.path}-wal) is {wal / 2**20:.0f} MiB and cannot start over: a "
                f"read transaction held open on {db.path} keeps it (another process reading "
                "it: e.g. an sqlite3 shell inside BEGIN); it grows with every write until that "
                f"ends, then goes back to {WAL_SIZE_LIMIT >> 20} MiB")})
        if (lost := db.guard.check()) is not None:  # found here too (the runner stops)
            degraded.insert(0, {"subsystem": "store", "cause": lost + "; the runner stops"})
        pace, now = db.pace, trio.current_time()
        waiting_s = pace.waiting_s(now)
        locked_s = 0.0 if pace.locked_since is None else now - pace.locked_since
        if pace.locked_since is not None:
            degraded.insert(0, {"subsystem": "store", "cause": (
                f"another connection has held the database's write lock for {locked_s:.1f} s "
                f"(another process: e.g. an sqlite3 shell in a write transaction on "
                f"{db.path}); the runner answers, but accepting, starting and ending jobs "
                "wait for it")})
        elif waiting_s >= STALLED_COMMIT_S:
            degraded.insert(0, {"subsystem": "store", "cause": (
                f"a commit has waited {waiting_s:.1f} s on the state file system; the runner "
                "answers, but accepting, starting and ending jobs wait for it")})
        report["store"] = {"commits": db.commits, "checkpoints": db.checkpoints,
                           "wal_bytes": wal,
                           **({} if db.last_checkpoint is None else
                              {"last_checkpoint": db.last_checkpoint}),
                           "commits_run_in": "thread" if pace.off_loop else "loop",
                           "slow_commits": pace.slow_commits,
                           "commits_in_thread": pace.commits_off_loop,
                           "longest_commit_ms": round(pace.longest_s * 1000.0, 3),
                           "commit_waiting_ms": round(waiting_s * 1000.0, 3),
                           "locked_writes": pace.locked_writes,
                           "locked_ms": round(locked_s * 1000.0, 3),
                           **({} if db.reserve is None else {"reserve": db.reserve.describe()})}
        if (sink := logsink.current()) is not None:  # `motor serve`'s (motor/logsink.py)
            report["log"] = sink.report()
            if (stalled := sink.stalled_s()) >= logsink.STALLED_S:
                degraded.append({"subsystem": "log", "cause": (
                    f"standard error has taken no log line for {stalled:.1f} s: nobody reads "
                    "it (a stalled journal, a paused pipe or terminal); the runner goes on, "
                    f"holding up to {logsink.QUEUE_LINES} lines, then dropping and counting "
                    "them")})
        report["status"] = "degraded" if degraded else "ok"
        report["degraded"] = degraded
        return report

    def _supervision_troubles(self) -> list[dict]:
        """Subsystems whose supervisor restarted a child within its window, or is down."""
        out = []
        for name in self.root.children():
            try:
                sup = self.root.ref(name)
            except KeyError:
                out.append({"subsystem": name, "cause": "not running"})
                continue
            if not isinstance(sup, actors.Supervisor):
                continue
            restarts = sup.restarts_in_window()
            if not restarts:
                # crashed this moment, its restart not under way yet (not yet counted)
                crash = next(iter(sup.crashed_unhandled().items()), None)
                if crash is not None:
                    out.append({"subsystem": name, "restarts": 0,
                                "cause": f"{crash[0]} crashed: {crash[1]!r}; restarting"})
                continue
            child, exc = sup.last_failure or (name, None)
            out.append({
                "subsystem": name, "restarts": restarts,
                "cause": (f"{child} crashed: {exc!r}; restarted {restarts} time(s) in the last"
                          f" {sup.period:g} s (more than {sup.intensity} stop the runner)")})
        return out

    async def workspaces(self) -> list[dict]:
        """The workspace catalog: kind, root, cached sizes, idle time, why protected."""
        return await self.handles.disk.listing()

    async def put_bundle(self, sha256: str, chunks: AsyncIterator[bytes]) -> dict:
        """Store a source bundle streamed as `chunks`: refused with runner_disk_full before
        the first chunk is read when below the floor; the digest is checked before the
        bundle is renamed into place; a failed upload leaves nothing behind. Jobs awaiting
        this bundle then join their queues."""
        disk, accounting = self.handles.disk, self.handles.accounting
        if not valid_sha(sha256):
            raise RefusedError(Refusal(
                code="bad_request",
                detail="a bundle is named by the 64 lowercase hex digits of its sha256"))
        refusal = await disk.admit_upload(sha256)
        if refusal is not None:  # counted with the submit-time refusals in health
            accounting.refused(refusal.code)
            raise RefusedError(refusal)
        upload = await disk.begin_upload(sha256)
        try:
            async for chunk in chunks:
                if chunk:
                    await self.clock.offload(upload.write, chunk)
            size = await disk.commit_upload(upload)
            if isinstance(size, Exception):  # returned by the disk actor, which carries on
                raise size
        except BundleError as exc:
            raise RefusedError(Refusal(code="bad_request", detail=str(exc))) from None
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            upload.abort()
            sample = await disk.sample()
            accounting.refused("runner_disk_full")
            raise RefusedError(Refusal(
                code="runner_disk_full", detail="the state filesystem filled up during the upload",
                free_bytes=sample.free_bytes, floor_bytes=self.config.floor_bytes())) from None
        finally:
            upload.abort()
        await self.handles.dispatcher.bundle_arrived(sha256)
        return {"sha256": sha256, "size": size, "stored": True}

    async def metrics_text(self) -> bytes:
        """`GET /metrics`: the health figures in Prometheus text format (a registry per runner)."""
        if getattr(self, "_metrics", None) is None:
            from ..accounting.metrics import Metrics

            self._metrics = Metrics()
        return self._metrics.render(await self.health())
