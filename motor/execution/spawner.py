"""Trio side of job execution: the forkserver client, keeper identity helpers, and
``open_spawner`` (which returns the keeperd client of keeperd_client.py by default; see
docs/keeper.md).

``open_spawner()`` starts the forkserver (``python .../motor/execution/forkserver.py``)
and ``Spawner.spawn(job_dir)`` asks it to fork a keeper for a job directory
whose ``spec.json`` is already written.  Keepers outlive both the forkserver
and the runner; the runner finds them again through ``keeper.json`` and
checks their identity with ``process_alive`` (pid + create time).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import psutil
import trio

from ..clock import WallClock

__all__ = [
    "CREATE_TIME_TOLERANCE_S",
    "JobDirClaimed",
    "KeeperHandle",
    "KeeperNotStarted",
    "Spawner",
    "SpawnerError",
    "cancel_keeper",
    "kill_marked_processes",
    "open_spawner",
    "process_alive",
    "wait_process_exit",
]

#: Create times are whole clock ticks (10 ms) plus the boot time, which moves
#: when the wall clock is stepped; compare with this tolerance.
CREATE_TIME_TOLERANCE_S = 1.0
#: How long one spawn request may take before the forkserver is presumed hung.
SPAWN_TIMEOUT_S = 30.0
#: A spawn waiting this long makes the health report `degraded` (`SpawnWaits`): a spawn
#: takes milliseconds, so this is a keeper process that does not answer (stopped, hung).
SPAWN_STALLED_S = 5.0
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


class SpawnerError(Exception):
    """The forkserver failed or died; the spawn may or may not have happened."""


class JobDirClaimed(SpawnerError):
    """The job directory already has a keeper (keeper.json exists): adopt it, never spawn."""


class KeeperNotStarted(SpawnerError):
    """The keeper's identity could not be recorded (e.g. no free inodes): the forkserver
    killed it before it could start anything; the job did not run."""


#: The environment variable every job process carries (set by the job actor).
JOB_MARKER = "MOTOR_JOB_ID"


def marked_pids(job_id: str) -> list[int]:
    """Pids of processes whose environment carries MOTOR_JOB_ID=<job_id> (a /proc scan)."""
    needle = f"{JOB_MARKER}={job_id}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(name))
    return found


def kill_marked_processes(job_id: str, *, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of the job found by its environment marker, until none is
    left (or ``timeout``). Blocking (run it in a thread). Returns the pids killed.

    The marker is the last resort of adoption: a keeper that died without a status may
    have left its job's processes behind, and with the affinity backend nothing else
    groups them."""
    import time

    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        live = []
        for pid in marked_pids(job_id):
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    continue
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
            live.append(pid)
            if pid not in killed:
                killed.append(pid)
        if not live or time.monotonic() >= deadline:
            return killed
        time.sleep(0.01)


@dataclass(frozen=True, slots=True)
class KeeperHandle:
    pid: int
    create_time: float


def keeper_of(resp: dict, who: str, path: str) -> KeeperHandle:
    """The keeper a spawn reply names, or the error it reports: JobDirClaimed (another
    keeper holds the job dir: adopt it), KeeperNotStarted (the job never ran) or
    SpawnerError. `who`: "forkserver" or "keeperd"."""
    if "error" in resp:
        code = resp.get("code")
        if code == "claimed":
            raise JobDirClaimed(resp["error"])
        if code == "spawn_failed":
            raise KeeperNotStarted(resp["error"])
        raise SpawnerError(f"{who} could not spawn {path}: {resp['error']}")
    return KeeperHandle(pid=int(resp["pid"]), create_time=float(resp["create_time"]))


# -- process identity ------------------------------------------------------


def process_alive(pid: int, create_time: float, *, tolerance: float = CREATE_TIME_TOLERANCE_S) -> bool:
    """True if ``pid`` exists, is not a zombie and was created at ``create_time``."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > tolerance:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # pragma: no cover - root on Linux
        return True


def _pidfd_for(pid: int, create_time: float, tolerance: float) -> int | None:
    """A pidfd for the process iff it is the one identified (race-free)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    # Checked after opening: the pidfd pins the process we verified.
    try:
        if not process_alive(pid, create_time, tolerance=tolerance):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


async def wait_process_exit(
    pid: int,
    create_time: float,
    *,
    tolerance: float = CREATE_TIME_TOLERANCE_S,
    poll_interval: float = 0.05,
) -> None:
    """Return when the process (pid, create_time) has exited.

    Returns at once if it is already gone, a zombie, or the pid now belongs to
    another process.  Uses a pidfd with ``trio.lowlevel.wait_readable``; falls
    back to polling psutil every ``poll_interval`` s if pidfd_open fails.
    """
    try:
        fd = _pidfd_for(pid, create_time, tolerance)
    except OSError:
        fd = -1
    if fd is None:
        return
    if fd < 0:
        while process_alive(pid, create_time, tolerance=tolerance):
            await trio.sleep(poll_interval)
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


def cancel_keeper(pid: int, create_time: float, *, tolerance: float = CREATE_TIME_TOLERANCE_S) -> bool:
    """SIGTERM the keeper if (pid, create_time) still identifies a live process.

    The keeper then SIGTERMs the job's process group, SIGKILLs it after
    ``kill_grace_s`` and records reason "cancelled".  Returns False if the
    keeper is gone (or the pid was reused).
    """
    try:
        fd = _pidfd_for(pid, create_time, tolerance)
    except OSError:
        if not process_alive(pid, create_time, tolerance=tolerance):
            return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True
    if fd is None:
        return False
    try:
        signal.pidfd_send_signal(fd, signal.SIGTERM)
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)
    return True


def cancel_keepers_under(root: os.PathLike[str] | str) -> int:
    """Cancel every keeper recorded under `root` (any `jobs/<id>/keeper.json` below it)
    whose job has no status yet: jobs outlive their runner, so a test or bench that
    stops its runners ends their jobs with this. Returns how many were signalled."""
    from pathlib import Path

    n = 0
    for kj in Path(root).glob("**/jobs/*/keeper.json"):
        if (kj.parent / "status.json").exists():
            continue
        try:
            kept = json.loads(kj.read_text())
            n += cancel_keeper(kept["keeper_pid"], kept["keeper_create_time"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return n


# -- forkserver client -----------------------------------------------------


class _Forkserver:
    """One running forkserver process and its line-oriented pipes."""

    def __init__(self, proc: trio.Process, clock: WallClock) -> None:
        self.proc = proc
        self.clock = clock
        self.pid = proc.pid
        self._buf = bytearray()
        self.broken = False

    async def read_line(self) -> dict:
        assert self.proc.stdout is not None
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                return json.loads(line)
            chunk = await self.proc.stdout.receive_some(65536)
            if not chunk:
                raise SpawnerError(
                    f"forkserver (pid {self.pid}) exited"
                    + (f" with code {self.proc.returncode}" if self.proc.poll() is not None else "")
                )
            self._buf += chunk

    def dead(self) -> bool:
        return self.broken or self.proc.poll() is not None

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Close its stdin (it exits, leaving keepers alone); kill if it lingers."""
        with trio.CancelScope(shield=True):
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                await self.proc.stdin.aclose()
            except trio.BrokenResourceError:  # pragma: no cover
                pass
            with self.clock.guard_move_on_after(timeout):
                await self.proc.wait()
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
            await self.proc.stdout.aclose()


class SpawnWaits:
    """When each spawn in flight was asked for (trio time), for the health report: before
    stop 59 a keeperd that did not answer (SIGSTOP, a hang) left jobs in set-up for 30 s
    at a time, then retried, while health said `ok`."""

    __slots__ = ("_since", "_next")

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._next = 0

    def begin(self) -> int:
        self._next += 1
        self._since[self._next] = trio.current_time()
        return self._next

    def end(self, key: int) -> None:
        self._since.pop(key, None)

    def longest_s(self, now: float) -> float:
        """How long the oldest spawn in flight has waited (0 when none)."""
        return now - min(self._since.values()) if self._since else 0.0


class _SpawnRequest:
    __slots__ = ("path", "event", "handle", "exc")

    def __init__(self, path: str) -> None:
        self.path = path
        self.event = trio.Event()
        self.handle: KeeperHandle | None = None
        self.exc: BaseException | None = None


class Spawner:
    """Client of one forkserver; use via ``open_spawner()``.

    ``spawn`` is safe to call from many tasks at once: requests go into a memory channel
    and one task (``_serve``, started by ``open_spawner``) owns the forkserver and handles
    them one at a time (the forkserver handles one at a time anyway). No lock.
    """

    def __init__(self, *, python: str = sys.executable, env: dict[str, str] | None = None,
                 clock: WallClock | None = None) -> None:
        # By path, not ``-m``: see motor/execution/scriptboot.py.
        self._cmd = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkserver.py")]
        self._env = env
        #: its guards against a hung forkserver run in real seconds (see WallClock)
        self._clock = clock or WallClock()
        self._send, self._receive = trio.open_memory_channel[_SpawnRequest](math.inf)
        self._server: _Forkserver | None = None
        self._next_id = 0
        self._closed = False
        self.waits = SpawnWaits()  # the spawns in flight, for health

    @property
    def forkserver_pid(self) -> int | None:
        """Pid of the current forkserver process (None before start / after stop)."""
        return self._server.pid if self._server is not None else None

    @property
    def keeper_process(self) -> str:
        """The process that spawns jobs, as health names it."""
        return f"the forkserver, pid {self.forkserver_pid or '?'}"

    async def _start(self) -> _Forkserver:
        try:
            proc = await trio.lowlevel.open_process(
                self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env
            )
        except OSError as exc:
            raise SpawnerError(f"cannot start forkserver: {exc}") from exc
        server = _Forkserver(proc, self._clock)
        try:
            with trio.CancelScope(shield=True):
                with self._clock.guard_fail_after(STARTUP_TIMEOUT_S):
                    hello = await server.read_line()
            if not hello.get("ready"):
                raise SpawnerError(f"unexpected forkserver greeting {hello!r}")
        except BaseException as exc:
            server.broken = True
            await server.stop(timeout=0)
            if isinstance(exc, trio.TooSlowError | ValueError):
                raise SpawnerError(f"forkserver did not start: {exc!r}") from exc
            raise
        return server

    async def _ensure_server(self) -> _Forkserver:
        if self._closed:
            raise SpawnerError("spawner is closed")
        if self._server is not None and self._server.dead():
            old, self._server = self._server, None
            await old.stop(timeout=0)
        if self._server is None:
            self._server = await self._start()
        return self._server

    async def _discard(self, server: _Forkserver) -> None:
        server.broken = True
        if self._server is server:
            self._server = None
        await server.stop(timeout=0)

    async def spawn(self, job_dir: os.PathLike[str] | str) -> KeeperHandle:
        """Fork a keeper for ``job_dir`` (its spec.json must exist).

        Returns once the forkserver reported the keeper's pid.  The
        request/response exchange is shielded from cancellation so a keeper
        that was forked is never silently lost; a cancelled caller sees
        ``Cancelled`` at its next checkpoint.  Raises ``SpawnerError`` if the
        forkserver died or failed during the request (the keeper may or may
        not exist: check the job directory); the next call starts a fresh
        forkserver.
        """
        path = os.path.abspath(os.fspath(job_dir))
        req = _SpawnRequest(path)
        try:
            self._send.send_nowait(req)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise SpawnerError("spawner is closed") from None
        key = self.waits.begin()
        with trio.CancelScope(shield=True):
            try:
                await req.event.wait()
            finally:
                self.waits.end(key)
        if req.exc is not None:
            raise req.exc
        assert req.handle is not None
        return req.handle

    async def _serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The one task that talks to the forkserver: a request at a time, in order.
        Ends when the spawner is closed (after the requests already queued), stopping the
        forkserver."""
        task_status.started()
        with trio.CancelScope(shield=True):
            async with self._receive:
                async for req in self._receive:
                    try:
                        req.handle = await self._spawn_one(req.path)
                    except Exception as exc:
                        req.exc = exc
                    finally:
                        req.event.set()
            self._closed = True
            if self._server is not None:
                server, self._server = self._server, None
                await server.stop()

    async def _spawn_one(self, path: str) -> KeeperHandle:
        self._next_id += 1
        req_id = self._next_id
        line = json.dumps({"id": req_id, "job_dir": path}).encode() + b"\n"
        for attempt in (1, 2):
            server = await self._ensure_server()
            assert server.proc.stdin is not None
            try:
                await server.proc.stdin.send_all(line)
                break
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                # Not delivered: safe to retry once on a fresh forkserver.
                await self._discard(server)
                if attempt == 2:
                    raise SpawnerError(f"forkserver pipe broken: {exc!r}") from exc
        try:
            with self._clock.guard_fail_after(SPAWN_TIMEOUT_S):
                while True:
                    resp = await server.read_line()
                    if resp.get("id") == req_id:
                        break
        except (SpawnerError, trio.TooSlowError, ValueError, trio.BrokenResourceError) as exc:
            await self._discard(server)
            if isinstance(exc, SpawnerError):
                raise
            raise SpawnerError(f"forkserver failed during spawn of {path}: {exc!r}") from exc
        return keeper_of(resp, "forkserver", path)

    # -- the keepers it started: real processes (motor.execution.ports.Keepers) ----------

    def exit_event(self, pid: int, create_time: float,
                   job_dir: os.PathLike[str] | str) -> trio.Event | None:
        return None  # a per-job keeper's end is waited for in `wait_exit`

    async def wait_exit(self, pid: int, create_time: float,
                        job_dir: os.PathLike[str] | str | None = None) -> None:
        if job_dir is not None and _keeperd_claim(job_dir):
            # kept by keeperd (a runner that used it before): done once the status is
            # written or keeperd is gone (a rare path: polled)
            status = os.path.join(job_dir, "status.json")
            while not os.path.exists(status) and process_alive(pid, create_time):
                await trio.sleep(0.05)
            return
        await wait_process_exit(pid, create_time)

    def cancel(self, pid: int, create_time: float,
               job_dir: os.PathLike[str] | str | None = None) -> bool:
        if job_dir is not None and _keeperd_claim(job_dir):
            # never SIGTERM keeperd for one job (that cancels all of them): ask it
            from .keeperd_client import cancel_once

            return cancel_once(job_dir)
        return cancel_keeper(pid, create_time)

    def kill_marked(self, job_id: str) -> list[int]:
        return kill_marked_processes(job_id)

    async def aclose(self) -> None:
        """No more requests; the serving task stops the forkserver (keepers keep running)."""
        self._send.close()


def _keeperd_claim(job_dir: os.PathLike[str] | str) -> bool:
    from .keeperd_client import is_keeperd_claim

    return is_keeperd_claim(job_dir)


#: How jobs are kept: "keeperd" (one long-lived keeper per state directory) or "forkserver"
#: (a keeper forked per job). Chosen with the environment variable MOTOR_SPAWNER.
SPAWNER_ENV = "MOTOR_SPAWNER"
SPAWNER_MODES = ("keeperd", "forkserver")
DEFAULT_SPAWNER_MODE = "keeperd"


def spawner_mode(mode: str | None = None) -> str:
    mode = mode or os.environ.get(SPAWNER_ENV) or DEFAULT_SPAWNER_MODE
    if mode not in SPAWNER_MODES:
        raise SpawnerError(f"{SPAWNER_ENV}={mode!r}: expected one of {', '.join(SPAWNER_MODES)}")
    return mode


@asynccontextmanager
async def open_spawner(
    *, python: str = sys.executable, env: dict[str, str] | None = None,
    clock: WallClock | None = None, state_dir: os.PathLike[str] | str | None = None,
    mode: str | None = None, prepare: dict | None = None,
) -> AsyncIterator[Spawner]:
    """The runner's Keepers: with ``state_dir`` and mode "keeperd" (``spawner_mode``) a
    client of that state directory's keeperd (started if none runs; `prepare`: keeperd's
    "prepare" request); otherwise a forkserver that forks a keeper per job, stopped on
    exit. Keepers and jobs keep running either way."""
    if state_dir is not None and spawner_mode(mode) == "keeperd":
        from .keeperd_client import open_keeperd_spawner

        async with open_keeperd_spawner(state_dir, python=python, env=env, clock=clock,
                                        prepare=prepare) as kd:
            yield kd  # type: ignore[misc]
        return
    spawner = Spawner(python=python, env=env, clock=clock)
    spawner._server = await spawner._start()
    async with trio.open_nursery() as nursery:
        await nursery.start(spawner._serve)
        try:
            yield spawner
        finally:
            await spawner.aclose()  # the serving task drains the queue, stops the forkserver
