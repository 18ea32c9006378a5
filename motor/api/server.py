"""Serve the ASGI app with hypercorn's trio protocol on the runner's Unix socket (and TCP).

`serve_api(app, config)` claims the socket path (a live runner there is an error, a stale
socket file is removed), binds `unix:<socket>` plus `config.listen` when set, and reports
`task_status.started(binds)` only once the sockets accept connections. The socket file
appears only once its socket listens with its mode (0600, or 0660 and the group when
`socket_group` is set): a client that finds it is never refused (`bind_listening`).

The accept loop is ours (hypercorn's `TCPServer` serves each connection), so that hostile
clients cannot hold the runner's memory or descriptors:

- listen backlog `LISTEN_BACKLOG` (the kernel clamps it to net.core.somaxconn), so a burst
  of connects is queued instead of refused with EAGAIN;
- at most `config.max_connections` open connections (clamped below RLIMIT_NOFILE); one more
  is answered `503 too_many_connections` and closed at once;
- a connection that has not sent a complete request head within `config.head_timeout_s`
  (`--head-timeout`, default `config.HEAD_TIMEOUT_S`) is closed
  (hypercorn's keep-alive timeout, kept by `_KeepAliveTimer`: one watcher per connection,
  not a task per request); request *bodies* have their own deadline in the app
  (`config.body_timeout_s`, see app.py);
- after connections close, freed heap memory is handed back to the kernel
  (glibc `malloc_trim`, at most once a second), so RSS returns near its baseline.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import grp
import json
import logging
import math
import os
import resource
import secrets
import socket
import stat
import struct
import termios
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from motor import faults
from motor.api.app import PUBLIC_ON_TCP
from motor.config import MAX_SOCKET_PATH, ConfigError, RunnerConfig

log = logging.getLogger("motor.api.server")


class SocketInUse(RuntimeError):
    """Another runner answers on the socket path."""


def resolve_group(name: str) -> int:
    """A group name or number -> gid; ConfigError when unknown."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group: no group named {name!r}") from None


async def claim_socket_path(path: Path, *, connect_timeout: float = 2.0) -> None:
    """Make `path` free to bind: raise SocketInUse when a live runner answers there,
    unlink it when it is a stale socket (connect refused), refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with trio.move_on_after(connect_timeout) as scope:
            try:
                await sock.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s", path)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                return
        if scope.cancelled_caught:
            # It exists and a connect neither succeeded nor was refused: someone owns it.
            raise SocketInUse(f"another runner is listening on {path} (connect timed out)")
        raise SocketInUse(f"another runner is listening on {path}")
    finally:
        sock.close()


def bind_listening(path: Path, backlog: int, gid: int | None) -> tuple[socket.socket, int]:
    """A Unix socket listening at `path`, mode 0600 (0660 and group `gid` when given), and
    the file's inode. The file appears only once the socket listens with its mode: it is
    bound at a hidden name beside `path` (`.motor-<pid>-<random>.sock`) and hard-linked into
    place. Before stop 76 hypercorn bound `path` and listened after it: a client that found
    the file in between was refused. A link, not a rename: a file put at `path` meanwhile
    (another runner's socket) is kept, and SocketInUse raised. A hidden name too long for
    sun_path is bound through /proc/self/fd."""
    tmp = f".motor-{os.getpid()}-{secrets.token_hex(4)}.sock"
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        address = os.path.join(path.parent, tmp)
        if len(os.fsencode(address)) > MAX_SOCKET_PATH:
            address = f"/proc/self/fd/{dfd}/{tmp}"
        # nobody else may connect before the mode is set: the file is made with the
        # socket's own mode (Linux), so the process's umask, which other threads use, stays
        os.fchmod(sock.fileno(), 0o600)
        sock.bind(address)
        try:
            if gid is not None:
                os.chown(tmp, -1, gid, dir_fd=dfd)
            os.chmod(tmp, 0o600 if gid is None else 0o660, dir_fd=dfd)
            faults.hit("api.bind")  # tests: bound, not listening; the loop is held here
            sock.listen(backlog)
            try:
                os.link(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except FileExistsError:
                raise SocketInUse(f"{path} appeared while this runner bound it") from None
            inode = os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_ino
        finally:
            os.unlink(tmp, dir_fd=dfd)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dfd)
    return sock, inode


#: Listen backlog for every socket (the kernel clamps it to net.core.somaxconn).
LISTEN_BACKLOG = 4096
#: a connection whose idle deadline passed with a request unread (its reader not run yet,
#: the runner's loop held up) gets this long to read it (`_KeepAliveTimer`)
STALL_GRACE_S = 1.0
#: When the server stops, an idle keep-alive connection is closed this long after: a request
#: its client sent just then is answered (with `connection: close`), not reset.
IDLE_CLOSE_GRACE_S = 0.25
#: once the server stops, how long a write may wait for a client that reads nothing more
#: (an event stream's follower that stopped reading) before its connection is given up
SEND_GRACE_S = 2.0
#: Connections above the cap being answered 503 at once; beyond it they are closed unanswered.
REFUSING_MAX = 64
#: Descriptors kept for everything else the runner opens (SQLite, logs, job pipes, cgroups).
FD_RESERVE = 256


def hypercorn_config(config: RunnerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [config.listen] if config.listen else []  # the Unix socket: bind_listening
    hc.accesslog = None  # quiet: no access log
    hc.errorlog = logging.getLogger("motor.api.hypercorn")
    hc.include_server_header = False
    hc.graceful_timeout = 3.0
    hc.backlog = LISTEN_BACKLOG
    # A connection is "idle" until its request head is complete: connect-only clients and
    # slow heads are closed after this; bodies are the app's business (body_timeout_s).
    hc.keep_alive_timeout = config.head_timeout_s
    return hc


def connection_cap(config: RunnerConfig) -> int:
    """`config.max_connections`, clamped so accepting never runs out of descriptors."""
    cap = config.max_connections
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):
        return cap
    if soft != resource.RLIM_INFINITY and cap > soft - FD_RESERVE:
        clamped = max(16, soft - FD_RESERVE)
        log.warning("max_connections %d clamped to %d (RLIMIT_NOFILE %d); raise LimitNOFILE",
                    cap, clamped, soft)
        cap = clamped
    return cap


def _load_malloc_trim() -> Callable[[], None] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Connections:
    """Counts open connections, refuses those above the cap, and trims the heap after
    connections close (a closed slow body leaves freed, fragmented heap behind)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.open = 0
        self.refused = 0
        self.refusing = 0
        self._closed = trio.Event()
        self._trim = _load_malloc_trim()

    async def trim_after_closes(self) -> None:
        if self._trim is None:
            return
        while True:
            await self._closed.wait()
            await trio.sleep(1.0)  # at most once a second, after a burst of closes
            self._closed = trio.Event()
            await trio.to_thread.run_sync(self._trim)  # walks the heap: not on the event loop

    def handler(self, serve_one: Callable[[Any], Awaitable[None]]):
        async def handle(stream: Any) -> None:
            if self.open >= self.cap:
                self.refused += 1
                if self.refused % 1000 == 1:
                    log.warning("connection cap %d reached: refusing connections (%d so far)",
                                self.cap, self.refused)
                if self.refusing >= REFUSING_MAX:  # a flood: do not answer, just close
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
                    return
                self.refusing += 1
                try:
                    await _refuse_connection(stream, self.cap)
                finally:
                    self.refusing -= 1
                return
            self.open += 1
            try:
                await serve_one(stream)
            finally:
                self.open -= 1
                self._closed.set()

        return handle


def _unread(stream: Any) -> bool:
    """Bytes the client sent that the connection's reader has not read yet (FIONREAD)."""
    sock = getattr(stream, "socket", None)
    try:
        fd = sock.fileno() if sock is not None else -1
        return fd != -1 and struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] > 0
    except OSError:
        return False


class _KeepAliveTimer:
    """hypercorn's keep-alive timer of one connection (its `TrioSingleTask` interface:
    `restart`, `stop`) with one watcher task for the connection's life and a deadline that
    `restart` sets and `stop` clears. hypercorn's own starts a task (`nursery.start`, a round
    trip through the scheduler) at every idle point and cancels it at every request head,
    each under a lock: with keep-alive, two of those per request (issue 14). What it does
    when the deadline passes is hypercorn's `TCPServer._idle_timeout`: close the connection
    (shielded). When the server terminates, a connection busy with a request is left to
    finish it (hypercorn closes it after the answer), and an idle one is closed after
    `IDLE_CLOSE_GRACE_S`: a request its client sent meanwhile is still answered, not reset."""

    def __init__(self, server: "_TCPServer") -> None:
        self._server = server
        self._deadline = math.inf
        self._scope: trio.CancelScope | None = None
        self._watching = False
        self._closed = False
        self._extended = False  # this idle spell's deadline moved for an unread request

    async def restart(self, task_group: Any, action: Any) -> None:
        timeout = self._server.config.keep_alive_timeout
        if self._server.context.terminated.is_set():
            timeout = min(timeout, IDLE_CLOSE_GRACE_S)
        self._set(trio.current_time() + timeout)
        self._extended = False  # (once per idle spell)
        if not self._watching and not self._closed:
            self._watching = True
            task_group._nursery.start_soon(self._watch)

    async def stop(self) -> None:
        self._set(math.inf)

    def close(self) -> None:
        """The connection is over: the watcher ends without closing anything."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()

    def _set(self, deadline: float) -> None:
        self._deadline = deadline
        if self._scope is not None:
            self._scope.deadline = deadline

    async def _watch(self) -> None:
        terminated = self._server.context.terminated
        while not self._closed:
            with trio.CancelScope(deadline=self._deadline) as self._scope:
                if terminated.is_set():
                    await trio.sleep_forever()  # until idle past the (short) deadline
                await terminated.wait()
                self._server.stop_sending()  # a write that waits on its client: a grace
                # the server is stopping: an idle connection has a short grace from now on
                # (a busy one, no deadline, finishes its request; hypercorn closes it then)
                if self._deadline != math.inf:
                    self._deadline = min(self._deadline, trio.current_time() + IDLE_CLOSE_GRACE_S)
            self._scope = None
            if trio.current_time() >= self._deadline:
                if not self._extended and _unread(self._server.stream):
                    # a request that came while the runner's loop was held (a disk stall,
                    # SIGSTOP) past the deadline: its reader has not run yet. Before stop 57
                    # it was reset unread (3 of 6 kept connections across an 8 s stall).
                    self._extended, self._deadline = True, trio.current_time() + STALL_GRACE_S
                    continue
                break  # idle (or without a complete request head) for keep_alive_timeout
        self._scope = None
        if self._closed:
            return
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()


class _TCPServer(TCPServer):
    """hypercorn's connection handler with a keep-alive timer that needs no task per
    request (`_KeepAliveTimer`), ending as soon as the client has closed: the timer would
    otherwise hold the finished connection (and its slot under the cap) for up to
    `--head-timeout` more."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = _KeepAliveTimer(self)
        self.sending: trio.CancelScope | None = None  # the write in progress (`protocol_send`)

    async def protocol_send(self, event: Any) -> None:
        """hypercorn's, but a write of nothing (h11's end of a body whose length was sent)
        is skipped on an open socket, and the send lock is taken without a schedule point
        when it is free: three writes per small response took six trips through the
        scheduler (the socket's own send still takes one)."""
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        sock = getattr(self.stream, "socket", None)
        if not event.data and sock is not None and sock.fileno() != -1 \
                and not sock.did_shutdown_SHUT_WR:
            return
        lock = self.send_lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()
        try:
            try:
                # shielded (a request's cancel must not cut a write in two), but not for
                # ever once the server stops: a client that reads no more would hold the
                # runner's stop (`stop_sending`; before stop 56 it did, without end)
                with trio.CancelScope(shield=True) as self.sending:
                    if self.context.terminated.is_set():
                        self.stop_sending()
                    await self.stream.send_all(event.data)
                if self.sending.cancelled_caught:
                    raise trio.BrokenResourceError("the client read nothing while the server stopped")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
        finally:
            self.sending = None
            lock.release()

    def stop_sending(self) -> None:
        """The server stops: the write in progress, if any, is given SEND_GRACE_S more."""
        if self.sending is not None:
            self.sending.deadline = min(self.sending.deadline, trio.current_time() + SEND_GRACE_S)

    async def _read_data(self) -> None:
        await super()._read_data()
        self.idle_task.close()


async def _refuse_connection(stream: Any, cap: int) -> None:
    """Answer 503 too_many_connections without reading the request, and close."""
    body = json.dumps({
        "refused": True, "code": "too_many_connections",
        "detail": f"the runner already serves {cap} connections (its max_connections); retry shortly",
    }).encode() + b"\n"
    head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(head + body)
            await stream.send_eof()
            # Read what the client already sent, so closing does not reset the connection
            # before it has read the answer (bounded: 1 s, 64 KiB).
            drained = 0
            while drained < 65536:
                data = await stream.receive_some(16384)
                if not data:
                    break
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
            pass
    with trio.CancelScope(shield=True):
        await stream.aclose()


async def _serve_hypercorn(
    app: Any,
    hc: HypercornConfig,
    bind_unix: Callable[[], tuple[socket.socket, int]],
    unix_path: Path,
    connections: Connections,
    shutdown_trigger: Callable[[], Awaitable[None]],
    unlink: Callable[[], None],
    watch: Callable[[Callable[[socket.socket], None]], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn's trio worker (hypercorn.trio.run.worker_serve) with our accept handler.

    The app's lifespan is a no-op, so it is not driven; every connection is served by
    hypercorn's TCPServer (HTTP/1.1 via h11). `bind_unix()` gives the Unix socket at
    `unix_path`, listening; hypercorn binds the TCP address, if any. When
    `shutdown_trigger()` returns: the socket file goes (`unlink`: a new client finds no
    runner), the connections the kernel already queued are accepted and served (closing a
    listener would reset them), the listeners close, and open requests have
    `graceful_timeout` to finish. `watch(add)` runs beside the accept loop; `add(sock)`
    serves one more bound socket (`_keep_socket_file`)."""
    wrapped = wrap_app(app, hc.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    sockets = hc.create_sockets()
    listeners = []
    binds = []
    try:
        sockets.insecure_sockets.insert(0, bind_unix()[0])
        for sock in sockets.insecure_sockets:
            sock.listen(hc.backlog)
            listeners.append(_KeptOpen(trio.SocketListener(trio.socket.from_stdlib_socket(sock))))
            binds.append("http://" + (f"unix:{unix_path}" if sock.family == socket.AF_UNIX
                                       else repr_socket_addr(sock.family, sock.getsockname())))
    except BaseException:
        for sock in sockets.insecure_sockets:
            sock.close()
        raise

    async def serve_one(stream: Any) -> None:
        await _TCPServer(wrapped, hc, context, ConnectionState({}), stream)

    async with trio.open_nursery() as server_nursery:
        task_status.started(binds)
        try:
            async with trio.open_nursery() as nursery:
                def add(sock: socket.socket) -> None:
                    sock.listen(hc.backlog)
                    sockets.insecure_sockets.append(sock)  # closed, its queue served, as the rest
                    listener = _KeptOpen(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                    nursery.start_soon(partial(
                        trio.serve_listeners, connections.handler(serve_one), [listener],
                        handler_nursery=server_nursery))

                nursery.start_soon(connections.trim_after_closes)
                nursery.start_soon(partial(
                    trio.serve_listeners, connections.handler(serve_one), listeners,
                    handler_nursery=server_nursery))
                if watch is not None:
                    nursery.start_soon(watch, add)
                await shutdown_trigger()
                nursery.cancel_scope.cancel()
            await faults.ahit("api.accepting_stopped")  # tests: a connection queued now
            unlink()
            handle = connections.handler(serve_one)
            for sock in sockets.insecure_sockets:
                for stream in _queued(sock):
                    server_nursery.start_soon(handle, stream)
        finally:
            for sock in sockets.insecure_sockets:
                sock.close()
            # Graceful: stop accepting, let open requests finish for graceful_timeout.
            await context.terminated.set()
            server_nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout


class _KeptOpen(trio.abc.Listener[trio.SocketStream]):
    """A listener that `trio.serve_listeners` cannot close. Its accept loop closes each
    listener when it is cancelled, and closing a listening socket resets the connections
    waiting in its backlog: these are taken after the loop stops (`_queued`), and the
    sockets closed after that (`_serve_hypercorn`)."""

    def __init__(self, listener: trio.SocketListener):
        self.listener = listener

    async def accept(self) -> trio.SocketStream:
        return await self.listener.accept()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


def _queued(listening: socket.socket) -> list[trio.SocketStream]:
    """The connections waiting in a listening socket's backlog, accepted without blocking
    (trio made the socket non-blocking)."""
    streams = []
    while True:
        try:
            sock, _ = listening.accept()
        except (BlockingIOError, InterruptedError):
            return streams
        except OSError:  # EMFILE and the like: the rest stay queued (reset at the close)
            return streams
        sock.setblocking(False)
        streams.append(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))


#: How often the runner looks for its socket file (`_keep_socket_file`): one `lstat`; a
#: removed file keeps clients away at most this long (10 s until stop 77).
SOCKET_CHECK_S = 2.0


async def _keep_socket_file(path: Path, bind: Callable[[], tuple[socket.socket, int]],
                            add: Callable[[socket.socket], None]) -> None:
    """Every SOCKET_CHECK_S: if the socket file is gone (a clean-up of old files, a hand),
    bind it again and serve it too. Before stop 49 the runner then went on, looking alive to
    its supervisor, while no client could reach it. A file put in its place is not ours and
    is left alone (logged). `bind()` gives the new socket, listening with its mode and group
    before its file appears (`bind_listening`), and the file's inode."""
    try:
        inode: int | None = os.stat(path).st_ino
    except OSError:
        inode = None  # gone already: bound again at the first check
    while True:
        await trio.sleep(SOCKET_CHECK_S)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError:
            continue
        if st is not None:
            if st.st_ino != inode:
                log.warning("%s is not this runner's socket any more; it is left alone, and "
                            "clients reach the runner there only once it is removed", path)
                inode = st.st_ino  # said once per replacement
            continue
        try:
            sock, inode = bind()
        except (OSError, SocketInUse) as exc:
            log.warning("%s was removed and cannot be bound again: %s", path, exc)
            continue
        add(sock)
        log.warning("%s was removed: listening on it again", path)


async def serve_api(
    app: Any,
    config: RunnerConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` until cancelled or until `shutdown_trigger()` returns (graceful).

    Raises SocketInUse (another runner answers on the socket) and ConfigError (unknown
    socket group).  `task_status.started(binds)` gets the bound addresses, e.g.
    `["http://unix:/run/motor.sock", "http://127.0.0.1:8080"]`, once they accept
    connections.  The socket file is removed on the way out when it is still ours.
    """
    path = config.socket_path
    gid = resolve_group(config.socket_group) if config.socket_group else None
    path.parent.mkdir(parents=True, exist_ok=True)
    await claim_socket_path(path)
    hc = hypercorn_config(config)
    connections = Connections(connection_cap(config))
    trigger = shutdown_trigger if shutdown_trigger is not None else trio.sleep_forever
    inode = None

    def unlink_ours() -> None:  # the socket file, while it is still ours
        try:
            if inode is not None and os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass

    def bind() -> tuple[socket.socket, int]:  # the socket file, listening: ours from now
        nonlocal inode
        sock, inode = bind_listening(path, hc.backlog, gid)
        return sock, inode

    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(_serve_hypercorn, app, hc, bind, path, connections,
                                        trigger, unlink_ours,
                                        partial(_keep_socket_file, path, bind))
            if config.listen and not getattr(app, "token", None):
                log.info("TCP %s without --token-file: serves only %s, read-only",
                         config.listen, ", ".join(f"{m} {p}" for m, p in sorted(PUBLIC_ON_TCP)))
            task_status.started(binds)
    finally:
        unlink_ours()
