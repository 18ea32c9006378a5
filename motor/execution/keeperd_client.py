"""The runner's side of keeperd (docs/keeper.md, "keeperd"): `KeeperdSpawner`.

It implements the Keepers port (motor/execution/ports.py) over keeperd's Unix socket
``<state>/keeperd.sock``. One task owns the connection: callers put requests into a memory
channel, that task sends them one at a time, a reader task hands each reply to the caller
that waits for it (by request id). No trio.Lock: the channel is the only way in.

Connecting: under ``<state>/keeperd.start.lock`` (flock; two runners racing for one state
dir serialize here) connect to the socket; if nothing answers, start keeperd
(``python .../keeperd.py STATE``; it detaches and prints one ready line) and connect again.
Opening the spawner and a spawn start keeperd when needed; a wait or a cancel never does
(no keeperd: nothing of that job is kept any more).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import trio

from ..clock import WallClock
from . import joblog
from .keeperd import KIND, LOCK_NAME, START_LOCK_NAME, socket_address
from .spawner import (
    CREATE_TIME_TOLERANCE_S, KeeperHandle, SpawnerError, SpawnWaits, cancel_keeper, keeper_of,
    kill_marked_processes, process_alive, wait_process_exit,
)

__all__ = ["KeeperdSpawner", "cancel_once", "is_keeperd_claim", "open_keeperd_spawner"]

SPAWN_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 30.0
#: The runner's start waits this long at most for keeperd's answer to its "prepare" (the
#: slot spares it asked for started: a scope's start is bounded by keeperd's own timeout)
PREPARE_WAIT_S = 5.0
#: A wait whose connection broke while keeperd still lives is re-sent after this pause.
RECONNECT_PAUSE_S = 0.05
#: At most this many spawned job dirs are remembered until their wait (then forgotten).
MAX_REMEMBERED = 100_000


class _NotRunning(SpawnerError):
    """No keeperd answers for this state directory (and this request may not start one)."""


#: every line to and from keeperd (msgspec: 0.2 against 2.6 us a line encoded with `json`)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode  # one line each; ValueError (DecodeError) if bad


@functools.lru_cache(maxsize=4096)
def _normed(path: str) -> str:
    return os.path.normpath(path)


def _dir_key(job_dir: os.PathLike[str] | str) -> str:
    """A job directory as keeperd is asked about it (`os.path.abspath`), without normalizing
    the same absolute path again on each of a job's requests (issue 14: four per job)."""
    path = os.fspath(job_dir)
    return _normed(path) if path[:1] == "/" else os.path.abspath(path)


def is_keeperd_claim(job_dir: os.PathLike[str] | str) -> bool:
    """Whether the job directory's keeper.json names keeperd (not a per-job keeper)."""
    try:
        kept = joblog.read_keeper(job_dir)
    except (joblog.JobDirError, OSError):
        return False
    return bool(kept) and kept.get("kind") == KIND


def _read_line(sock: socket.socket, deadline: float) -> tuple[dict, bytes] | None:
    """One JSON line from a blocking socket (None at EOF), and what followed it."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("keeperd did not greet in time")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    return _decode(line), rest


def _try_connect(state_dir: str, deadline: float) -> tuple[socket.socket, dict, bytes] | None:
    addr, dfd = socket_address(state_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.connect(addr)
        finally:
            if dfd is not None:
                os.close(dfd)
        got = _read_line(sock, deadline)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    if got is None or not got[0].get("keeperd"):  # it was exiting (idle): start another
        sock.close()
        return None
    sock.settimeout(None)
    return sock, got[0], got[1]


def connect_or_launch(state_dir: str, cmd: list[str], env: dict[str, str] | None,
                      launch: bool, timeout: float = STARTUP_TIMEOUT_S,
                      ) -> tuple[socket.socket, dict, bytes] | None:
    """Blocking (run it in a thread): a connected socket, keeperd's greeting and any bytes
    after it; None when none runs and ``launch`` is false. Raises SpawnerError."""
    deadline = time.monotonic() + timeout
    try:
        lock_fd = os.open(os.path.join(state_dir, START_LOCK_NAME),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SpawnerError(f"cannot reach keeperd in {state_dir}: {exc}") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        for attempt in range(3):
            got = _try_connect(state_dir, deadline)
            if got is not None or not launch:
                return got
            try:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, env=env, start_new_session=True, close_fds=True)
            except OSError as exc:
                raise SpawnerError(f"cannot start keeperd: {exc}") from exc
            assert proc.stdout is not None
            with proc.stdout:
                fd = proc.stdout.fileno()
                buf = b""
                while b"\n" not in buf:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([fd], [], [], left)[0]:
                        proc.kill()
                        proc.wait()
                        raise SpawnerError("keeperd did not start in time")
                    chunk = os.read(fd, 4096)
                    if not chunk:
                        break
                    buf += chunk
            proc.wait()
            try:
                hello = _decode(buf.partition(b"\n")[0]) if buf else {}
            except ValueError:
                hello = {}
            if not hello.get("ready"):
                if str(hello.get("error", "")).startswith("another keeperd holds") \
                        and (got := _wake_lock_holder(state_dir, deadline)):
                    return got
                raise SpawnerError(
                    f"keeperd did not start: {hello.get('error') or f'exit code {proc.returncode}'}")
        raise SpawnerError("keeperd started but does not answer on its socket")
    except OSError as exc:
        raise SpawnerError(f"cannot reach keeperd in {state_dir}: {exc}") from exc
    finally:
        os.close(lock_fd)


#: How long a lock holder woken by SIGUSR1 is given to listen again.
RELISTEN_WAIT_S = 5.0
RELISTEN_POLL_S = 0.02
_SIGUSR1_BIT = 1 << (10 - 1)  # in /proc/<pid>/status's SigCgt (SIGUSR1 is 10 on Linux)


def _wake_lock_holder(state_dir: str, deadline: float) -> tuple[socket.socket, dict, bytes] | None:
    """A keeperd holds ``keeperd.lock`` but nothing answers on ``keeperd.sock`` (the socket
    file was removed under it): ask it to listen again (SIGUSR1, only to a keeperd that
    catches it: an older one would die of it) and connect. None if it cannot be asked or
    does not answer in time (docs/keeper.md, "A socket gone")."""
    try:
        with open(os.path.join(state_dir, LOCK_NAME)) as f:
            pid = int(f.read().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"keeperd" not in f.read():
                return None
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        if not caught & _SIGUSR1_BIT:
            return None
        os.kill(pid, signal.SIGUSR1)
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    until = min(deadline, time.monotonic() + RELISTEN_WAIT_S)
    while (got := _try_connect(state_dir, deadline)) is None and time.monotonic() < until:
        time.sleep(RELISTEN_POLL_S)
    return got


def cancel_once(job_dir: os.PathLike[str] | str, timeout: float = 2.0) -> bool:
    """Blocking: ask the keeperd of the job's state dir (``<state>/jobs/<id>``) to cancel
    the job over a connection of its own; never starts keeperd. For a runner that keeps its
    jobs with per-job keepers and finds a job keeperd keeps (docs/keeper.md)."""
    path = os.path.abspath(os.fspath(job_dir))
    state_dir = os.path.dirname(os.path.dirname(path))
    try:
        got = _try_connect(state_dir, time.monotonic() + timeout)
        if got is None:
            return False
        sock = got[0]
        with sock:
            sock.settimeout(timeout)
            sock.sendall(_encode({"id": 1, "op": "cancel", "job_dir": path}) + b"\n")
            answer = _read_line(sock, time.monotonic() + timeout)
    except (OSError, ValueError):
        return False
    return bool(answer and answer[0].get("sent"))


class _Req:
    __slots__ = ("op", "job_dir", "launch", "event", "resp", "exc", "identity", "watch",
                 "watch_at")

    def __init__(self, op: str, job_dir: str, launch: bool, watch: "_Req | None" = None) -> None:
        self.op = op
        self.job_dir = job_dir
        self.launch = launch
        self.event = trio.Event()
        self.resp: dict | None = None
        self.exc: BaseException | None = None
        self.identity: tuple[int, float] | None = None
        #: a spawn's wait for the job's end, sent with it (`"watch"`: its own request id),
        #: and where it waits for its answer (the connection and that id)
        self.watch = watch
        self.watch_at: tuple[_Conn, int] | None = None

    def resolve(self, resp: dict | None = None, exc: BaseException | None = None) -> None:
        if not self.event.is_set():
            self.resp, self.exc = resp, exc
            self.event.set()


class _Conn:
    def __init__(self, sock: socket.socket, hello: dict, rest: bytes) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.raw = sock  # the same socket (non-blocking now): `KeeperdSpawner._submit` sends on it
        self.identity = (int(hello["pid"]), float(hello["create_time"]))
        self.buf = bytearray(rest)
        self.pending: dict[int, _Req] = {}
        self.dead = False

    def lost(self, why: str) -> None:
        self.dead = True
        for req in self.pending.values():
            req.resolve(exc=SpawnerError(f"keeperd (pid {self.identity[0]}) connection lost: {why}"))
        self.pending.clear()


class KeeperdSpawner:
    """The Keepers port backed by keeperd; use via ``open_keeperd_spawner()``."""

    def __init__(self, state_dir: os.PathLike[str] | str, *, python: str = sys.executable,
                 env: dict[str, str] | None = None, clock: WallClock | None = None,
                 prepare: dict | None = None) -> None:
        self.state_dir = os.path.abspath(os.fspath(state_dir))
        #: sent to each keeperd this spawner connects to (keeperd's "prepare": what the
        #: runner's first jobs would have it make, made at once)
        self._prepare = prepare
        #: the last "prepare" sent, resolved by keeperd's answer: once what it asked for is
        #: made (its slot spares started or refused), or with the connection's loss
        self.prepared: _Req | None = None
        here = os.path.dirname(os.path.abspath(__file__))
        self._cmd = [python, os.path.join(here, "keeperd.py"), self.state_dir]
        self._env = env
        self._clock = clock or WallClock()
        self._send, self._receive = trio.open_memory_channel[_Req](math.inf)
        #: requests handed to the connection's task and not yet delivered by it: while
        #: there are any, a request waits its turn behind them (`_submit`)
        self._queued = 0
        self._conn: _Conn | None = None
        self._nursery: trio.Nursery | None = None
        self._next_id = 0
        #: job dirs this spawner had keeperd claim, by path: the identity of the keeperd
        #: that answered (kept until the job's wait returns). A wait or cancel for one of
        #: them knows its claim names keeperd without reading keeper.json again.
        self._spawned: dict[str, tuple[int, float]] = {}
        #: of those, the ones whose end keeperd reports unasked (the spawn carried the wait)
        self._watches: dict[str, _Req] = {}
        self.waits = SpawnWaits()  # the spawns in flight, for health

    @property
    def keeperd_pid(self) -> int | None:
        """Pid of the keeperd this runner is connected to (None when not connected)."""
        conn = self._conn
        return conn.identity[0] if conn is not None and not conn.dead else None

    @property
    def keeper_process(self) -> str:
        """The process that spawns jobs, as health names it."""
        return f"keeperd, pid {self.keeperd_pid or '?'}"

    # -- the task that owns the connection ---------------------------------------------

    async def _manage(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._receive:
            async for req in self._receive:
                try:
                    if isinstance(req, bytes):  # the rest of a line `_submit` began
                        await self._send_rest(req)
                    else:
                        await self._deliver(req)
                finally:
                    self._queued -= 1
        if self._conn is not None:
            await self._conn.stream.aclose()

    async def _connect(self, launch: bool) -> _Conn | None:
        got = await trio.to_thread.run_sync(
            connect_or_launch, self.state_dir, self._cmd, self._env, launch)
        if got is None:
            return None
        conn = _Conn(*got)
        assert self._nursery is not None
        self._nursery.start_soon(self._read, conn)
        if self._prepare:  # its answer (id 0) resolves `prepared`; a runner's start waits for it
            self.prepared = conn.pending[0] = _Req("prepare", "", False)
            try:
                await conn.stream.send_all(_encode(
                    {"id": 0, "op": "prepare", **self._prepare}) + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                conn.lost(repr(exc))  # the request at hand connects again
        return conn

    async def _deliver(self, req: _Req) -> None:
        for attempt in (1, 2):
            conn = self._conn
            if conn is None or conn.dead:
                if conn is not None:
                    await conn.stream.aclose()
                self._conn = None
                try:
                    conn = await self._connect(req.launch)
                except SpawnerError as exc:
                    req.resolve(exc=exc)
                    return
                if conn is None:
                    req.resolve(exc=_NotRunning(f"no keeperd runs for {self.state_dir}"))
                    return
                self._conn = conn
            req_id, line = self._frame(conn, req)
            try:
                await conn.stream.send_all(line)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                # not delivered (or the connection broke at once): a new connection, once
                conn.pending.pop(req_id, None)
                _drop_watch(req)
                conn.lost(repr(exc))
                if attempt == 2:
                    req.resolve(exc=SpawnerError(f"keeperd connection broken: {exc!r}"))

    def _frame(self, conn: _Conn, req: _Req) -> tuple[int, bytes]:
        """Give `req` (and the wait a spawn carries) its request ids on `conn`, where their
        answers are awaited; its id and the line to send."""
        self._next_id += 1
        req_id = self._next_id
        req.identity = conn.identity
        conn.pending[req_id] = req
        msg = {"id": req_id, "op": req.op, "job_dir": req.job_dir}
        if req.watch is not None:
            self._next_id += 1
            msg["watch"] = self._next_id
            req.watch_at, req.watch.identity = (conn, self._next_id), conn.identity
            conn.pending[self._next_id] = req.watch
        return req_id, _encode(msg) + b"\n"

    async def _send_rest(self, rest: bytes) -> None:
        conn = self._conn
        if conn is None or conn.dead:
            return  # its requests were failed with the connection (`_Conn.lost`)
        try:
            await conn.stream.send_all(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            conn.lost(repr(exc))

    async def _read(self, conn: _Conn) -> None:
        why = "closed by keeperd"
        try:
            while True:
                nl = conn.buf.find(b"\n")
                while nl >= 0:
                    line = bytes(conn.buf[:nl])
                    del conn.buf[:nl + 1]
                    resp = _decode(line)
                    req = conn.pending.pop(resp.get("id"), None)
                    if req is not None:
                        req.resolve(resp)
                    nl = conn.buf.find(b"\n")
                chunk = await conn.stream.receive_some(65536)
                if not chunk:
                    break
                conn.buf += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError) as exc:
            why = repr(exc)
        finally:
            conn.lost(why)

    def _submit(self, req: _Req) -> None:
        """Send `req` now, from the caller's task, when the connection is up and nothing
        is waiting to be sent (a non-blocking send of one short line; the connection's task
        would cost a task switch and its turn in the run queue on every job's start path);
        otherwise the connection's task sends it, in order, connecting first if need be.
        A line the socket takes only in part is finished by that task before anything else."""
        conn = self._conn
        if conn is not None and not conn.dead and self._queued == 0:
            req_id, line = self._frame(conn, req)
            try:
                sent = conn.raw.send(line)
            except OSError:  # full (BlockingIOError) or broken: as if never tried
                conn.pending.pop(req_id, None)
                _drop_watch(req)
            else:
                if sent == len(line):
                    return
                req = line[sent:]  # type: ignore[assignment]
        try:
            self._send.send_nowait(req)
            self._queued += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if isinstance(req, _Req):
                req.resolve(exc=SpawnerError("spawner is closed"))

    # -- the Keepers port ---------------------------------------------------------------

    async def spawn(self, job_dir: os.PathLike[str] | str) -> KeeperHandle:
        """Ask keeperd to claim ``job_dir`` and start its job (spec.json must exist).

        Shielded from cancellation (a claimed job is never silently lost; a cancelled
        caller gets the handle and sees Cancelled at its next checkpoint). Raises
        JobDirClaimed, KeeperNotStarted, or SpawnerError (keeperd died or was unreachable
        during the request: the job may or may not run, look at keeper.json)."""
        path = _dir_key(job_dir)
        req = _Req("spawn", path, launch=True, watch=_Req("wait", path, launch=False))
        with trio.CancelScope(shield=True):
            self._submit(req)
            key = self.waits.begin()
            try:
                with self._clock.guard_fail_after(SPAWN_TIMEOUT_S):
                    await req.event.wait()
            except trio.TooSlowError:
                if self._conn is not None:
                    self._conn.lost("no answer in time")
                    await self._conn.stream.aclose()
                raise SpawnerError(f"keeperd did not answer the spawn of {path} in time") from None
            finally:
                self.waits.end(key)
        resp = req.resp
        if req.exc is not None or resp is None or not resp.get("watching"):
            _drop_watch(req)  # a refusal, a lost connection, or a keeperd that does not watch
        if req.exc is not None:
            raise req.exc
        assert resp is not None
        handle = keeper_of(resp, "keeperd", path)
        if len(self._spawned) >= MAX_REMEMBERED:  # waits that never came (crashed actors)
            self._spawned.clear()
            self._watches.clear()
        self._spawned[path] = (handle.pid, handle.create_time)
        if req.watch_at is not None:  # keeperd tells us of the job's end: no wait to send
            self._watches[path] = req.watch
        return handle

    def _ours(self, job_dir: os.PathLike[str] | str, pid: int, create_time: float) -> bool:
        """This spawner had keeperd (pid, create_time) claim ``job_dir``: its keeper.json
        names keeperd (no need to read it)."""
        known = self._spawned.get(_dir_key(job_dir))
        return known is not None and _same(known, (pid, create_time))

    def _alive(self, pid: int, create_time: float) -> bool:
        """keeperd (pid, create_time) lives: our connection to it is up (no /proc read),
        else ask /proc."""
        conn = self._conn
        if conn is not None and not conn.dead and _same(conn.identity, (pid, create_time)):
            return True
        return process_alive(pid, create_time)

    async def wait_exit(self, pid: int, create_time: float,
                        job_dir: os.PathLike[str] | str | None = None) -> None:
        """Return once the job's keeper is done with it: for keeperd, once the job's
        status.json is written or keeperd (pid, create_time) is gone; for a per-job keeper
        (an older runner's), once that process exited."""
        if job_dir is None or not (self._ours(job_dir, pid, create_time)
                                   or is_keeperd_claim(job_dir)):
            await wait_process_exit(pid, create_time)
            return
        path = _dir_key(job_dir)
        try:
            await self._wait_keeperd(path, pid, create_time)
        finally:
            self._spawned.pop(path, None)
            self._watches.pop(path, None)

    def exit_event(self, pid: int, create_time: float,
                   job_dir: os.PathLike[str] | str) -> trio.Event | None:
        """The event of the wait this spawner's spawn of the job carried (keeperd answers it
        at the job's end, or the connection's loss sets it); None when there is none."""
        watch = self._watches.get(_dir_key(job_dir))
        if watch is None or watch.identity is None or not _same(watch.identity, (pid, create_time)):
            return None
        return watch.event

    async def _wait_keeperd(self, path: str, pid: int, create_time: float) -> None:
        sent = self._watches.pop(path, None)  # the wait that went with the spawn, if any
        while self._alive(pid, create_time):
            if sent is not None and sent.identity is not None \
                    and _same(sent.identity, (pid, create_time)):
                req, sent = sent, None
            else:
                req, sent = _Req("wait", path, launch=False), None
                self._submit(req)
            if not req.event.is_set():  # (set: the job actor waited on `exit_event`)
                await req.event.wait()
            if req.identity is not None and not _same(req.identity, (pid, create_time)):
                await wait_process_exit(pid, create_time)  # not the keeperd on our socket
                return
            if req.exc is None:
                return  # done (status written, or keeperd no longer keeps it)
            if isinstance(req.exc, _NotRunning):
                await wait_process_exit(pid, create_time)
                return
            await trio.sleep(RECONNECT_PAUSE_S)  # connection lost: look again

    def cancel(self, pid: int, create_time: float,
               job_dir: os.PathLike[str] | str | None = None) -> bool:
        """Ask the job's keeper to cancel it (keeperd: over the socket; it SIGTERMs the job's
        tree, SIGKILLs it after the grace, records "cancelled"). False when it is gone."""
        if job_dir is None or not (self._ours(job_dir, pid, create_time)
                                   or is_keeperd_claim(job_dir)):
            return cancel_keeper(pid, create_time)
        if not self._alive(pid, create_time) or os.path.exists(
                os.path.join(job_dir, joblog.STATUS_FILE)):
            return False  # keeperd is gone, or done with this job
        self._submit(_Req("cancel", _dir_key(job_dir), launch=False))
        return True

    def kill_marked(self, job_id: str) -> list[int]:
        return kill_marked_processes(job_id)

    async def aclose(self) -> None:
        """Disconnect (keeperd and its jobs keep running)."""
        self._send.close()


def _drop_watch(req: _Req) -> None:
    """The wait sent with a spawn will not be answered (or is not needed): forget it."""
    if req.watch_at is not None:
        conn, watch_id = req.watch_at
        conn.pending.pop(watch_id, None)
        req.watch_at = None


def _same(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= CREATE_TIME_TOLERANCE_S


@asynccontextmanager
async def open_keeperd_spawner(
    state_dir: os.PathLike[str] | str, *, python: str = sys.executable,
    env: dict[str, str] | None = None, clock: WallClock | None = None,
    prepare: dict | None = None,
) -> AsyncIterator[KeeperdSpawner]:
    """A KeeperdSpawner for ``state_dir``, connected (keeperd started if none runs);
    disconnects on exit (reconnecting whenever needed meanwhile). keeperd and the jobs it
    keeps outlive it. `prepare`: keeperd's "prepare" request, sent on each connection; the
    first one's answer is awaited here, at most `PREPARE_WAIT_S`."""
    spawner = KeeperdSpawner(state_dir, python=python, env=env, clock=clock, prepare=prepare)
    try:
        async with trio.open_nursery() as nursery:
            spawner._nursery = nursery
            # Connect (starting keeperd if none runs) now, at the runner's start, as the
            # forkserver is started: the first job does not wait for it.
            spawner._conn = await spawner._connect(launch=True)
            await nursery.start(spawner._manage)
            if spawner.prepared is not None:  # the first jobs find what it makes ready
                with trio.move_on_after(PREPARE_WAIT_S):
                    await spawner.prepared.event.wait()
                if not spawner.prepared.event.is_set():
                    logging.getLogger("motor.execution").warning(
                        "start-up: keeperd had not prepared the first jobs' spares within "
                        "%gs; serving now, the first jobs may start without them",
                        PREPARE_WAIT_S)
            try:
                yield spawner
            finally:
                await spawner.aclose()
                nursery.cancel_scope.cancel()
    finally:  # however the runner ends, our end of the socket is closed (keeperd stays)
        conn, spawner._conn = spawner._conn, None
        if conn is not None:
            conn.lost("spawner closed")
            conn.stream.socket.close()
