"""The runner's supervisor tree: start-up in order (state dir, lock, host probe, store,
sweep, slots, spawner), the subsystems' child specs and how each finds its siblings, and the
orderly stop. The tree's shape is drawn in motor/runner/__init__.py.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import trio

import actors

from .. import faults
from ..accounting.actor import AccountingActor
from ..clock import WallClock
from ..config import RunnerConfig, parse_size
from ..cpu.actor import CpuActor
from ..cpu.core import CpuPlacement
from ..disk.actor import DiskActor
from ..disk.fsinfo import journal_warning
from ..disk.live import LiveIndex
from ..execution.actor import JobDeps
from ..execution.jobdir import EndedDirs
from ..execution.spawner import kill_marked_processes, open_spawner
from ..handles import (
    AccountingHandle, CpuHandle, DiskHandle, DispatcherHandle, ExecutionHandle, Records,
    StoreHandle,
)
from ..maintenance import Maintenance
from ..memory.core import unit_limit
from ..memory.host import read_ceiling
from ..records import CAPABILITIES
from ..scheduling.actor import DispatchDeps, Dispatcher
from ..store.actor import StoreActor, open_database
from ..store.reserve import FILE_NAME as RESERVE_FILE, Reserve, reserve_bytes
from ..store.hub import ChangeHub
from ..store.db import StoreError
from ..store.fileguard import DatabaseLost
from ..store.files import private_umask
from .facade import Runner
from .host import (
    Host, StartupError, StateDirLock, WorkspaceRootLocks, _make_dir, _state_dir_problem,
    check_database_present, probe_host,
)


#: a subsystem's supervisor restarts its actor up to this many times in this many seconds,
#: then gives up, which stops the runner (exit status 3)
SUBSYSTEM_INTENSITY, SUBSYSTEM_PERIOD_S = 5, 10.0

def _crashing(factory):
    def make():
        actor = factory()

        async def handle(msg):
            raise faults.FaultInjected(f"{actor.name}: injected crash on {type(msg).__name__}")

        actor.handle = handle
        actor.immediate = ()  # every message to `handle`, none at once in its sender's task
        return actor

    return make


def _single(name: str, factory, ref: actors.ActorRef) -> actors.ChildSpec:
    """A subsystem: its own supervisor with its actor as the only child, answering on `ref`
    (made before the tree starts, so siblings get their handles at construction)."""
    if faults.crashes(name):
        factory = _crashing(factory)
    return actors.ChildSpec(name=name, factory=lambda: actors.Supervisor(
        name, [actors.ChildSpec(name=name, factory=factory, ref=ref)], strategy="one_for_one",
        intensity=SUBSYSTEM_INTENSITY, period=SUBSYSTEM_PERIOD_S))


#: the subsystems that are one actor each, in start order (the execution supervisor, with
#: one child per job, starts between accounting and the dispatcher)
SUBSYSTEMS = ("store", "cpu", "disk", "accounting", "dispatcher", "maintenance", "api")


class Handles:
    """Every subsystem's ref and typed handle, made before anything starts."""

    def __init__(self, db, tree: "_Tree", config: RunnerConfig):
        self.refs = {name: actors.ActorRef(name) for name in SUBSYSTEMS}
        self.records = Records(db)
        self.store = StoreHandle(self.refs["store"])
        self.cpu = CpuHandle(self.refs["cpu"])
        self.disk = DiskHandle(self.refs["disk"])
        self.accounting = AccountingHandle(self.refs["accounting"])
        self.dispatcher = DispatcherHandle(self.refs["dispatcher"], config.change_timeout_s)
        #: a nested supervisor is a new object after a restart: looked up when used
        self.execution = ExecutionHandle(lambda: tree.root.ref("execution"))


@asynccontextmanager
async def open_runner(config: RunnerConfig, *, api: bool = False) -> AsyncIterator[Runner]:
    """Start the runner's supervisor tree; stop it in order on exit."""
    config.validate()
    with private_umask():  # before anything is created: state files are 0600, dirs 0700
        async with _open_runner(config, api=api) as runner:
            yield runner


@asynccontextmanager
async def _open_runner(config: RunnerConfig, *, api: bool) -> AsyncIterator[Runner]:
    state = config.state_path
    jobs_dir = state / "jobs"
    roots = config.workspace_roots
    for path in (state, jobs_dir, *roots):
        _make_dir(path, state)
    lock = StateDirLock(state)
    try:
        lock.acquire()
    except OSError as exc:
        raise StartupError(_state_dir_problem(state, lock.path, exc)) from None
    root_locks = WorkspaceRootLocks(roots, state)
    try:
        root_locks.acquire()
    except BaseException:
        lock.release()
        raise
    try:
        check_database_present(state / "motor.db", jobs_dir)
        host = probe_host(config)
        if api:
            from ..api.server import SocketInUse, claim_socket_path

            try:
                await claim_socket_path(config.socket_path)
            except SocketInUse as exc:
                raise StartupError(str(exc)) from None
        floor, goal = config.floor_bytes(), config.goal_bytes()
        reserve = Reserve(state / RESERVE_FILE, reserve_bytes(floor), goal) if floor else None
        try:
            db = open_database(state, max_output_bytes=parse_size(config.max_output_bytes_per_job),
                               reserve=reserve)
        except StoreError as exc:
            raise StartupError(str(exc)) from None
        if reserve is not None:
            reserve.ensure()
        clock = config.clock or WallClock()
        hub = ChangeHub()
        await _sweep_leftover_groups(host.backend, db, jobs_dir)
        slots = await _make_slots(config, host)
        try:
            async with open_spawner(clock=clock, state_dir=state,
                                    prepare=spawner_preparation(host.backend, slots)) as spawner:
                tree = _Tree()
                handles = Handles(db, tree, config)
                job_deps = JobDeps(
                    config=config, records=handles.records, store=handles.store,
                    dispatcher=handles.dispatcher, cpu=handles.cpu,
                    accounting=handles.accounting, disk=handles.disk, spawner=spawner,
                    backend=host.backend, clock=clock, jobs_dir=jobs_dir,
                    workspace_root=roots[0], stopping=lambda: not tree.root.alive)
                followers: set[str] = set()  # jobs a client follows (kept across restarts)
                children = _children(config, host, db, hub, job_deps, handles, followers,
                                     tree, api)
                # A subsystem whose supervisor gives up takes the runner down (the
                # service manager restarts it): never limp on with a dead subsystem.
                root = actors.Supervisor("runner", children, strategy="one_for_one",
                                         intensity=0, period=30.0)
                tree.root = root
                tree.runner = runner = Runner(config, root, db, hub, host, clock,
                                              handles=handles, followers=followers,
                                              spawner=spawner)
                async with trio.open_nursery() as nursery:
                    await nursery.start(root.run)
                    watch = trio.CancelScope()  # until the runner stops
                    nursery.start_soon(_stop_if_the_database_is_lost, db, root, watch)
                    if warning := journal_warning(str(state), host.state_fs):
                        logging.getLogger("motor.runner").warning("runner: %s", warning)
                    try:
                        yield runner
                    finally:
                        watch.cancel()
                        root.shutdown()
        finally:
            db.close()
    finally:
        root_locks.release()
        lock.release()


#: how often an idle runner checks that motor.db is still the file its store has open
#: (a commit, and health, check it each time): found within this, its records are saved
#: before a crash or a reboot could lose them with the open file
DATABASE_CHECK_S = 10.0


async def _stop_if_the_database_is_lost(db, root: actors.Supervisor,
                                        watch: trio.CancelScope) -> None:
    """When motor.db's path no longer names the file the store has open (removed, or
    another file put there: store/fileguard.py), stop the runner in order, its last writes
    going to the open file, which the database saves as it closes, and raise
    DatabaseLost: `motor serve` exits 5 and, restarted, goes on from the saved records."""
    lost, token = trio.Event(), trio.lowlevel.current_trio_token()

    def tell() -> None:  # from the thread of the commit that found it
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(lost.set)

    db.guard.on_lost = tell
    with watch:
        while not lost.is_set():
            with trio.move_on_after(DATABASE_CHECK_S):
                await lost.wait()
            if db.guard.check() is not None:  # an idle runner too: no commit finds it
                lost.set()
    if not lost.is_set():
        return  # the runner stops
    await root.aclose()
    db.close()  # the records saved now, so that the message can say where
    raise DatabaseLost(f"{db.guard.lost}; runner stopped, its records saved to "
                       f"{db.guard.saved_to or 'nowhere (see the log)'}")


def spawner_preparation(backend, slots: list[dict] | None = None) -> dict | None:
    """keeperd's "prepare" for this runner's isolation backend: a systemd runner names its
    manager, whose D-Bus client keeperd then imports and connects at once, not at the
    first job, and the slot slices made at the start (`_make_slots`), where keeperd makes
    its spares then; a cgroup v1 runner names its parent groups, where keeperd fills its
    pool of spares then (docs/keeper.md, "Prepared at the runner's start")."""
    if backend.name == "systemd":
        return {"systemd_address": backend.address, **({"slots": list(slots)} if slots else {})}
    parents = backend.spare_parents()
    return {"spare_parents": parents} if parents else None


#: the slot slices a systemd runner makes at its start by default (`--start-slots`): one per
#: allocatable CPU, at most --max-weight and this many
START_SLOTS = 8


async def _make_slots(config: RunnerConfig, host: Host) -> list[dict]:
    """A systemd runner's slot slices for its first jobs, made before it serves
    (docs/isolation.md, "Slots made at the start"): one per job of one CPU, on the CPUs
    the allocator gives the first such jobs, with such a job's memory limit. Their scopes,
    for keeperd's "prepare"; a slot that cannot be made is logged, and its first job makes
    it as before."""
    count = config.start_slots
    if count is None:
        count = min(len(host.allowed), config.max_weight, START_SLOTS)
    if host.backend.name != "systemd" or count == 0:  # only systemd has slot slices
        return []
    placement = CpuPlacement(host.topology, host.allowed)
    memory_max = unit_limit(parse_size(config.memory_per_vcpu_bytes), host.ceiling)
    wanted = [(list(placement.place(f"slot-{n}", 1).cpus), memory_max) for n in range(count)]
    scopes, problems = await trio.to_thread.run_sync(host.backend.make_slots, wanted)
    for line in problems:
        logging.getLogger("motor.isolation").warning("start-up: %s; its first job makes it", line)
    return scopes


async def _sweep_leftover_groups(backend, db, jobs_dir: Path) -> None:
    """Before any job is adopted: remove the isolation groups/units of this state dir's jobs
    that the store does not know as setting up or running; another runner's on a shared
    parent are left alone (docs/isolation.md, "Start-up sweep")."""
    known = {r.job_id for r in db.active()}
    owned = {p.name for p in jobs_dir.iterdir() if p.is_dir()}  # this state dir's jobs
    for line in await trio.to_thread.run_sync(backend.sweep, known, owned):
        logging.getLogger("motor.isolation").warning("start-up sweep: %s", line)
    # a job recorded running whose record cannot be read is not adopted (salvage.py): with
    # no group to sweep (affinity, none), its processes are found by their marker
    for job_id in db.active_unreadable():
        if killed := await trio.to_thread.run_sync(kill_marked_processes, job_id):
            logging.getLogger("motor.runner").warning(
                "start-up: job %s, whose record cannot be read, left processes %s: stopped",
                job_id, killed)


class _Tree:
    """The root supervisor and the facade, for what is made after the children's specs
    (the execution supervisor's current incarnation, the api's runner)."""

    root: actors.Supervisor
    runner: "Runner"


def _children(config, host: Host, db, hub, job_deps: JobDeps, handles: Handles,
              followers: set[str], tree: _Tree, api: bool):
    refs = handles.refs

    def recorded_cpus():
        return {r.job_id: r.cpus for r in db.active() if r.cpus}

    def dispatcher():
        return Dispatcher(DispatchDeps(
            job=job_deps, execution=handles.execution, disk=handles.disk,
            claim_limit=host.claim_limit, capabilities=CAPABILITIES, ceiling=host.ceiling,
            followers=followers))

    def read_memory_ceiling():
        host.ceiling = read_ceiling(config.capacity_file, host.slice_limit, host.ceiling)
        return host.ceiling

    live_index = LiveIndex(db.live)  # outlives disk actor restarts; fed by every commit
    ended_dirs = EndedDirs(job_deps.jobs_dir, db.ended_between)  # (and its mark, both's)
    hub.watchers.append(live_index.apply)
    specs = [
        _single("store", lambda: StoreActor(db, hub, offload=job_deps.clock.offload),
                refs["store"]),
        _single("cpu", lambda: CpuActor(host.topology, host.allowed, host.kept_back, recorded_cpus,
                                        windows_cpus=host.windows,
                                        windows_slot_lock=config.windows_slot_lock),
                refs["cpu"]),
        _single("disk", lambda: DiskActor(
            config.state_path, config.floor_bytes(), config.goal_bytes(),
            workspace_roots=config.workspace_roots, caller_roots=config.caller_roots,
            cap_bytes=parse_size(config.build_folder_cap_bytes), clock=job_deps.clock,
            live_jobs=db.live, compile_cache=config.compile_cache, live_index=live_index,
            job_recorded=db.has,
            offload=job_deps.clock.offload, ended_dirs=ended_dirs,
            floors_for=config.floors_for, reserve=db.reserve), refs["disk"]),
        _single("accounting", lambda: AccountingActor(handles.records, job_deps.clock),
                refs["accounting"]),
        actors.ChildSpec(name="execution", factory=lambda: actors.Supervisor(
            "execution", [], strategy="one_for_one", intensity=50, period=10.0)),
        _single("dispatcher", dispatcher, refs["dispatcher"]),
        _single("maintenance", lambda: Maintenance(
            store=handles.store, clock=job_deps.clock,
            jobs_dir=job_deps.jobs_dir, read_ceiling=read_memory_ceiling,
            interval_s=config.maintenance_interval_s, offload=job_deps.clock.offload,
            disk=handles.disk, dispatcher=handles.dispatcher,
            ceiling=host.ceiling, ended_dirs=ended_dirs), refs["maintenance"]),
    ]
    if api:
        from ..api.actor import ApiActor

        # called when the tree starts, once the facade exists
        specs.append(_single("api", lambda: ApiActor(tree.runner), refs["api"]))
    return specs
