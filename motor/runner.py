"""open_runner: the runner's supervisor tree, and the `Runner` facade over it.

```
runner (one_for_one)
├── store        StoreActor        sole writer of records and events (SQLite)
├── cpu          CpuActor          placement state
├── disk         DiskActor         free-space admission
├── accounting   AccountingActor   refusal and end counts for health
├── execution    (dynamic)         one JobExecution per job setting up or running
├── dispatcher   Dispatcher        queue, permits, start/end/cancel/withdraw
├── maintenance  Maintenance       retention pass every minute
└── api          ApiActor          HTTP on the Unix socket (only under `serve`)
```
Each subsystem is its own supervisor with its actor as child, so a crash restarts only that
actor (rebuilding its state from the store) and a crash loop escalates to the root.
Children start in this order and stop in reverse: the API stops accepting first, the
store closes last.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import trio

import actors

from .accounting.actor import AccountingActor, AdmissionRefused, Report, notify
from .clock import WallClock, uuid7_ms
from .config import ConfigError, RunnerConfig, parse_size
from .cpu.actor import CpuActor, Snapshot
from .cpu.topology import (
    TopologyError, allocatable, claim_limit, kept_back, parse_cpu_list, read_topology,
    validate_linux_cpus,
)
from .config import parse_size
from .disk.actor import AdmitUpload, BeginUpload, CommitUpload, DiskActor, Listing, Sample, offload
from .disk.bundles import BundleError, valid_sha
from .disk.live import LiveIndex
from .execution.actor import JobDeps
from .execution.spawner import open_spawner
from .isolation import HostProbe, IsolationError, choose_backend
from .maintenance import Maintenance
from .memory.host import read_ceiling
from .records import (
    CAPABILITIES, Event, JobRecord, JobRequest, Queued, Refusal, RefusedError,
    TERMINAL_STATES, Truncated, decode_event, public_record,
)
from .scheduling.actor import DispatchDeps, Dispatcher
from .scheduling.messages import (
    BundleArrived, CancelJob, Heartbeat, QueuedView, StatusView, Submit, Unfollowed, Withdraw,
)
from .store.actor import ChangeHub, StoreActor, open_database
from .store.db import StoreError

log = logging.getLogger("motor.runner")

RETENTION_MS = 24 * 3600 * 1000


class StartupError(ConfigError):
    """The runner cannot start with this configuration on this host (exit status 2)."""


class StateDirLock:
    """One runner per state dir: an exclusive flock on `<state-dir>/runner.lock`."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "runner.lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StartupError(
                f"state dir {self.path.parent} is in use by another runner (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _single(name: str, factory) -> actors.ChildSpec:
    """A subsystem: its own supervisor with its actor as the only child."""
    return actors.ChildSpec(name=name, factory=lambda: actors.Supervisor(
        name, [actors.ChildSpec(name=name, factory=factory)], strategy="one_for_one",
        intensity=5, period=10.0))


@dataclass
class Host:
    """What start-up learned about the host: topology, CPUs, isolation backend."""

    topology: Any
    allowed: tuple[int, ...]
    kept_back: tuple[int, ...]
    claim_limit: int
    backend: Any
    windows: tuple[int, ...] = ()  # --windows-cpus
    slice_limit: Any = None  # () -> int | None: the jobs group's live memory limit
    ceiling: Any = None  # MemoryCeiling read at start-up


def probe_host(config: RunnerConfig) -> Host:
    try:
        topology = read_topology(config.sysfs_root)
    except TopologyError as exc:
        raise StartupError(f"cannot read CPU topology: {exc}") from None
    linux = None
    if config.linux_cpus is not None:
        try:
            linux = parse_cpu_list(config.linux_cpus)
            validate_linux_cpus(topology, linux, config.max_weight)
        except ValueError as exc:
            raise StartupError(f"--linux-cpus: {exc}") from None
    windows: tuple[int, ...] = ()
    if config.windows_cpus:
        try:
            windows = parse_cpu_list(config.windows_cpus)
        except ValueError as exc:
            raise StartupError(f"--windows-cpus: {exc}") from None
        offline = [c for c in windows if not topology.is_online(c)]
        if offline:
            raise StartupError(f"--windows-cpus: CPU {offline[0]} is not online")
    allowed = allocatable(topology, linux)
    if not allowed:
        raise StartupError("no allocatable CPUs on this host")
    try:
        backend = choose_backend(config.isolation, probe=HostProbe(config.cgroup_parent))
    except IsolationError as exc:
        raise StartupError(str(exc)) from None
    slice_limit = getattr(backend, "parent_memory_limit", None) or (lambda: None)
    return Host(
        topology=topology, allowed=tuple(allowed),
        kept_back=() if linux is not None else tuple(kept_back(topology)),
        claim_limit=claim_limit(allowed, config.max_weight, confined=linux is not None),
        backend=backend, slice_limit=slice_limit, windows=windows,
        ceiling=read_ceiling(config.capacity_file, slice_limit),
    )


class Runner:
    """The embedding API: the same actors `serve` runs, called from Python."""

    capabilities = CAPABILITIES

    def __init__(self, config: RunnerConfig, root: actors.Supervisor, db, hub: ChangeHub,
                 host: Host, clock):
        self.config = config
        self.root = root
        self.db = db
        self.hub = hub
        self.host = host
        self.clock = clock

    # -- refs -----------------------------------------------------------------------------

    def actor(self, name: str) -> actors.ActorRef:
        return self.root.ref(name).ref(name)

    @property
    def dispatcher(self) -> actors.ActorRef:
        return self.actor("dispatcher")

    # -- jobs -----------------------------------------------------------------------------

    async def submit(self, req: JobRequest, *, follow: bool = False) -> JobRecord:
        reply = await self.dispatcher.call(Submit(req, follow))
        if isinstance(reply, Refusal):
            raise RefusedError(reply)
        return reply

    async def get(self, job_id: str) -> JobRecord:
        record = self.db.get(job_id)
        if record is None:
            raise RefusedError(self._missing(job_id))
        if record.state == "queued":
            live = await self.dispatcher.call(QueuedView(job_id))
            if live is not None:
                return live
        return record

    def _missing(self, job_id: str) -> Refusal:
        born = uuid7_ms(job_id)
        if born and born + RETENTION_MS <= self.clock.now_ms():
            return Refusal(code="history_expired",
                           detail=f"job {job_id} is older than the 24 h retention")
        return Refusal(code="not_found", detail=f"no job {job_id} on this runner")

    async def jobs(self, *, all: bool = False) -> list[JobRecord]:
        if all:
            return self.db.listing(limit=10_000)
        return self.db.listing(limit=200)

    async def events(self, job_id: str, from_seq: int = 0) -> AsyncIterator[Event]:
        """Replay stored events from `from_seq`, then follow until the terminal event.

        While the job is queued, a `queued` heartbeat with the live queue_wait_ms and
        waiting_on is yielded every heartbeat interval; heartbeats are not stored and
        repeat the seq of the latest stored event.
        """
        record = self.db.get(job_id)
        if record is None:
            raise RefusedError(self._missing(job_id))
        next_seq = max(from_seq, 0)
        last_seq = 0
        while True:
            changed = self.hub.changed(job_id)
            truncated = self.db.truncated_before(job_id)
            if next_seq < truncated:  # those pages were evicted: say so, never skip silently
                # The boundary comes first (seq just before what is replayed, so seqs stay
                # ordered), then the lifecycle events that pages never evict, then the rest.
                yield Truncated(seq=max(next_seq - 1, 0), truncated_before_seq=truncated)
                kept = [decode_event(raw) for raw in
                        self.db.events_from(job_id, next_seq, limit=truncated - next_seq)]
                for event in (e for e in kept if e.seq < truncated):
                    yield event
                    last_seq = event.seq
                    if event.__struct_config__.tag == "terminal":
                        return
                next_seq = truncated
            rows = self.db.events_from(job_id, next_seq)
            for raw in rows:
                event = decode_event(raw)
                yield event
                next_seq = last_seq = event.seq
                next_seq += 1
                if event.__struct_config__.tag == "terminal":
                    return
            if rows:
                continue
            record = self.db.get(job_id)
            if record is None:
                raise RefusedError(self._missing(job_id))
            if record.state in TERMINAL_STATES and not self.db.events_from(job_id, next_seq):
                return
            with trio.move_on_after(self.config.heartbeat_s):
                await changed.wait()
                continue
            if record.state == "queued":
                beat = await self.dispatcher.call(Heartbeat(job_id))
                if beat is not None:
                    beat.seq = last_seq
                    yield beat

    async def follow(self, job_id: str) -> AsyncIterator[Event]:
        """`events(job_id)` for the client that submitted the job and follows it.

        While it follows, that client enforces the job's queue-wait budget (it withdraws
        the job when its local deadline passes). If it goes away before the job ends, the
        runner takes over enforcing the budget with the same rule.
        """
        ended = False
        try:
            async for event in self.events(job_id, 0):
                if event.__struct_config__.tag == "terminal":
                    ended = True
                yield event
        finally:
            if not ended:
                with trio.CancelScope(shield=True):
                    try:
                        await self.dispatcher.cast(Unfollowed(job_id))
                    except actors.ActorDead:
                        pass

    async def cancel(self, job_id: str) -> JobRecord:
        await self.get(job_id)
        await self.dispatcher.call(CancelJob(job_id))
        return await self.get(job_id)

    async def withdraw(self, job_id: str) -> str:
        await self.get(job_id)
        answer = await self.dispatcher.call(Withdraw(job_id))
        if answer == "unknown":  # already ended: it started (or was cancelled) before
            return "started" if self.db.get(job_id).started_at_ms else "withdrawn"
        return answer

    # -- reports --------------------------------------------------------------------------

    async def status(self) -> dict:
        view = await self.dispatcher.call(StatusView())
        records = (self.db.get(job_id) for job_id in view.pop("active"))
        view["running"] = [public_record(r) for r in records if r is not None]
        return view

    async def health(self) -> dict:
        view = await self.dispatcher.call(StatusView())
        disk = await self.actor("disk").call(Sample())
        cpus = await self.actor("cpu").call(Snapshot())
        try:  # accounting figures are optional: a stuck accounting actor never stalls a probe
            ledger = await self.actor("accounting").call(Report(self.clock.now_ms()), timeout=10)
        except (actors.ActorDead, actors.CallTimeout):
            ledger = {"admission_refusals": {}, "finished": {}, "underused": [],
                      "repositories": {}, "queue_wait_hourly": [], "accounting_unavailable": True}
        report = {
            "isolation": self.host.backend.health(),
            "capacity": view["capacity"],
            "cpus": {"online": cpus["online"], "allowed": cpus["allowed"],
                     "kept_back": cpus["kept_back"], "jobs": cpus["jobs"]},
            "disk": {"free_bytes": disk.free_bytes, "total_bytes": disk.total_bytes,
                     "floor_bytes": self.config.floor_bytes(), "goal_bytes": self.config.goal_bytes()},
        }
        report.update(ledger)
        return report

    async def workspaces(self) -> list[dict]:
        """The workspace catalog: kind, root, cached sizes, idle time, why protected."""
        return await self.actor("disk").call(Listing())

    async def put_bundle(self, sha256: str, chunks: AsyncIterator[bytes]) -> dict:
        """Store a source bundle streamed as `chunks`: refused with runner_disk_full before
        the first chunk is read when below the floor; the digest is checked before the
        bundle is renamed into place; a failed upload leaves nothing behind. Jobs awaiting
        this bundle then join their queues."""
        disk = self.actor("disk")
        if not valid_sha(sha256):
            raise RefusedError(Refusal(
                code="bad_request",
                detail="a bundle is named by the 64 lowercase hex digits of its sha256"))
        refusal = await disk.call(AdmitUpload(sha256))
        if refusal is not None:  # counted with the submit-time refusals in health
            notify(self.actor("accounting"), AdmissionRefused(refusal.code))
            raise RefusedError(refusal)
        upload = await disk.call(BeginUpload(sha256))
        try:
            async for chunk in chunks:
                if chunk:
                    await offload(upload.write, chunk)
            size = await disk.call(CommitUpload(upload))
            if isinstance(size, Exception):  # returned by the disk actor, which carries on
                raise size
        except BundleError as exc:
            raise RefusedError(Refusal(code="bad_request", detail=str(exc))) from None
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            upload.abort()
            sample = await disk.call(Sample())
            notify(self.actor("accounting"), AdmissionRefused("runner_disk_full"))
            raise RefusedError(Refusal(
                code="runner_disk_full", detail="the state filesystem filled up during the upload",
                free_bytes=sample.free_bytes, floor_bytes=self.config.floor_bytes())) from None
        finally:
            upload.abort()
        await self.dispatcher.cast(BundleArrived(sha256))
        return {"sha256": sha256, "size": size, "stored": True}

    async def metrics_text(self) -> bytes:
        """`GET /metrics`: the health figures in Prometheus text format (a registry per runner)."""
        if getattr(self, "_metrics", None) is None:
            from .accounting.metrics import Metrics

            self._metrics = Metrics()
        return self._metrics.render(await self.health())


@asynccontextmanager
async def open_runner(config: RunnerConfig, *, api: bool = False) -> AsyncIterator[Runner]:
    """Start the runner's supervisor tree; stop it in order on exit."""
    config.validate()
    state = config.state_path
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    jobs_dir = state / "jobs"
    jobs_dir.mkdir(exist_ok=True)
    roots = config.workspace_roots
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
    lock = StateDirLock(state)
    lock.acquire()
    try:
        host = probe_host(config)
        if api:
            from .api.server import SocketInUse, claim_socket_path

            try:
                await claim_socket_path(config.socket_path)
            except SocketInUse as exc:
                raise StartupError(str(exc)) from None
        try:
            db = open_database(state, max_output_bytes=parse_size(config.max_output_bytes_per_job))
        except StoreError as exc:
            raise StartupError(str(exc)) from None
        clock = config.clock or WallClock()
        hub = ChangeHub()
        try:
            async with open_spawner() as spawner:
                tree = _Tree()
                job_deps = JobDeps(
                    config=config, db=db, store=None, dispatcher=None, cpu=None,
                    accounting=None, spawner=spawner, backend=host.backend, clock=clock,
                    jobs_dir=jobs_dir, workspace_root=roots[0])
                children = _children(config, host, db, hub, job_deps, tree, api)
                root = actors.Supervisor("runner", children, strategy="one_for_one",
                                         intensity=3, period=30.0)
                tree.root = root
                tree.runner = runner = Runner(config, root, db, hub, host, clock)
                async with trio.open_nursery() as nursery:
                    await nursery.start(root.run)
                    try:
                        yield runner
                    finally:
                        root.shutdown()
        finally:
            db.close()
    finally:
        lock.release()


class _Tree:
    """Lets children's factories find their siblings' refs once the root exists."""

    root: actors.Supervisor
    runner: "Runner"


def _children(config, host: Host, db, hub, job_deps: JobDeps, tree: _Tree, api: bool):
    def recorded_cpus():
        return {r.job_id: r.cpus for r in db.live() if r.state in ("setup", "running") and r.cpus}

    def dispatcher():
        root = tree.root
        job_deps.store = root.ref("store").ref("store")
        job_deps.cpu = root.ref("cpu").ref("cpu")
        job_deps.accounting = root.ref("accounting").ref("accounting")
        job_deps.disk = root.ref("disk").ref("disk")
        return Dispatcher(DispatchDeps(
            job=job_deps, execution=root.ref("execution"),
            disk=root.ref("disk").ref("disk"), claim_limit=host.claim_limit,
            capabilities=CAPABILITIES, ceiling=host.ceiling))

    def read_memory_ceiling():
        host.ceiling = read_ceiling(config.capacity_file, host.slice_limit, host.ceiling)
        return host.ceiling

    live_index = LiveIndex(db.live)  # outlives disk actor restarts; fed by every commit
    hub.watchers.append(live_index.apply)
    specs = [
        _single("store", lambda: StoreActor(db, hub)),
        _single("cpu", lambda: CpuActor(host.topology, host.allowed, host.kept_back, recorded_cpus,
                                        windows_cpus=host.windows,
                                        windows_slot_lock=config.windows_slot_lock)),
        _single("disk", lambda: DiskActor(
            config.state_path, config.floor_bytes(), config.goal_bytes(),
            workspace_roots=config.workspace_roots, caller_roots=_caller_roots(config),
            cap_bytes=parse_size(config.build_folder_cap_bytes), clock=job_deps.clock,
            live_jobs=db.live, compile_cache=config.compile_cache, live_index=live_index,
            job_recorded=lambda job_id: db.get(job_id) is not None)),
        _single("accounting", lambda: AccountingActor(db, job_deps.clock)),
        actors.ChildSpec(name="execution", factory=lambda: actors.Supervisor(
            "execution", [], strategy="one_for_one", intensity=50, period=10.0)),
        _single("dispatcher", dispatcher),
        _single("maintenance", lambda: Maintenance(
            store=tree.root.ref("store").ref("store"), clock=job_deps.clock,
            jobs_dir=job_deps.jobs_dir, read_ceiling=read_memory_ceiling,
            interval_s=config.maintenance_interval_s,
            disk=lambda: tree.root.ref("disk").ref("disk"),
            dispatcher=lambda: tree.root.ref("dispatcher").ref("dispatcher"),
            ceiling=host.ceiling)),
    ]
    if api:
        from .api.actor import ApiActor

        specs.append(_single("api", lambda: ApiActor(tree)))
    return specs


def _caller_roots(config) -> dict[str, str]:
    out = {}
    for spec in config.caller_root:
        caller, _, host = spec.partition("=")
        out[caller] = host
    return out


# -- serve -----------------------------------------------------------------------------------


async def serve_forever(config: RunnerConfig) -> None:
    """`motor serve`: run the tree with the API until SIGINT/SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_runner(config, api=True) as runner:
            print(f"motor: listening on {config.socket_path}"
                  + (f" and http://{config.listen}" if config.listen else ""),
                  f"(state {config.state_path}, isolation {runner.host.backend.name},"
                  f" max_weight {config.max_weight}, claim limit {runner.host.claim_limit})",
                  flush=True)
            async for signum in signals:
                log.info("runner: %s, stopping (running jobs keep running)",
                         signal.Signals(signum).name)
                break
