"""The keep-alive timer of each connection (motor/api/server.py `_KeepAliveTimer`): one
watcher per connection whose deadline moves, instead of hypercorn's task per request.
Served for real by hypercorn on a Unix socket (FakeRunner behind the app)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import trio
from fake_runner import FakeRunner
from socket_helpers import response_head, take_response

from motor.api import make_app, serve_api
from motor.api import server as server_mod
from motor.config import RunnerConfig

HEAD = b"GET /v1/health HTTP/1.1\r\nHost: motor\r\n\r\n"


async def read_response(stream: trio.SocketStream, buf: bytearray) -> bytes:
    """One whole response (head and a content-length body) from a kept-alive connection."""
    while (got := take_response(buf)) is None:
        data = await stream.receive_some(65536)
        assert data, "the connection closed before a whole response came"
        buf += data
    return got[0] + b"\r\n\r\n" + got[1]


async def read_eof(stream: trio.SocketStream) -> bytes:
    got = b""
    while data := await stream.receive_some(65536):
        got += data
    return got


async def serve_until_stopped(nursery, config):
    """The API served until `stop` is set (its shutdown trigger): (app, stop, served), where
    `served` is set once `serve_api` has returned."""
    stop, served = trio.Event(), trio.Event()
    app = make_app(FakeRunner(config))

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await serve_api(app, config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            served.set()

    await nursery.start(serve)
    return app, stop, served


@pytest.fixture
def short_timeout(config):
    """A request-head timeout of 0.5 s (below `--head-timeout`'s least, 2 s: this config
    is not validated)."""
    config.head_timeout_s = 0.5


async def test_each_request_restarts_the_timer_and_an_idle_connection_is_closed(
        config, nursery, short_timeout):
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    stream = await trio.open_unix_socket(str(config.socket_path))
    buf = bytearray()
    # 8 requests 0.25 s apart: 2 s on one connection, four times its idle timeout
    for _ in range(8):
        await stream.send_all(HEAD)
        answer = await read_response(stream, buf)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
        await trio.sleep(0.25)
    # then idle: closed by the runner (EOF, no answer), long before this test's own limit
    with trio.fail_after(10):
        assert await read_eof(stream) == b""
    await stream.aclose()


async def test_a_connection_that_sends_no_request_head_is_closed(config, nursery, short_timeout):
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    stream = await trio.open_unix_socket(str(config.socket_path))
    await stream.send_all(b"GET /v1/health HTTP/1.1\r\n")  # an unfinished head, then silence
    with trio.fail_after(10):
        assert await read_eof(stream) == b""
    await stream.aclose()


async def test_connections_that_ended_give_their_slot_back(short_dir, nursery):
    """A closed connection's watcher ends with it: with a cap of 3, twenty connections one
    after the other (each with a request, then closed by the client) and then three at once
    are all served, none refused as too many."""
    config = RunnerConfig(state_dir=str(short_dir), socket=str(short_dir / "m.sock"),
                          max_connections=3)
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    for _ in range(20):
        stream = await trio.open_unix_socket(str(config.socket_path))
        await stream.send_all(HEAD)
        assert (await read_response(stream, bytearray())).startswith(b"HTTP/1.1 200")
        await stream.aclose()
        await trio.sleep(0.01)
    streams = [await trio.open_unix_socket(str(config.socket_path)) for _ in range(3)]
    for stream in streams:
        await stream.send_all(HEAD)
    for stream in streams:
        answer = await read_response(stream, bytearray())
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        await stream.aclose()


async def test_a_shutdown_closes_kept_alive_connections_and_the_server_returns(config, nursery):
    shutdown = trio.Event()
    done = trio.Event()

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        await serve_api(make_app(FakeRunner(config)), config, shutdown_trigger=shutdown.wait,
                        task_status=task_status)
        done.set()

    await nursery.start(serve)
    stream = await trio.open_unix_socket(str(config.socket_path))
    await stream.send_all(HEAD)
    answer = await read_response(stream, bytearray())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    shutdown.set()  # the connection is idle, kept alive (HEAD_TIMEOUT_S is 5 s here)
    with trio.fail_after(10):
        assert await read_eof(stream) == b""
        await done.wait()
    await stream.aclose()


async def test_at_shutdown_a_request_on_an_idle_connection_is_still_answered(
        config, nursery, monkeypatch):
    """The server stops (its shutdown trigger): a client that sends its next request on a
    kept-alive connection just then gets its answer, saying `connection: close`, and then
    the connection closes; a connection that stays idle is closed after the grace; the
    server then returns. Before: every connection was closed at once, a request sent
    meanwhile reset or left unanswered."""
    monkeypatch.setattr(server_mod, "IDLE_CLOSE_GRACE_S", 2.0)
    app, stop, served = await serve_until_stopped(nursery, config)
    busy = await trio.open_unix_socket(str(config.socket_path))
    idle = await trio.open_unix_socket(str(config.socket_path))
    for stream in (busy, idle):
        await stream.send_all(HEAD)
        assert (await read_response(stream, bytearray())).startswith(b"HTTP/1.1 200")
    app.stop()
    stop.set()
    await trio.sleep(0.05)  # the server has stopped accepting
    assert not config.socket_path.exists()
    await busy.send_all(HEAD)
    with trio.fail_after(10):
        answer = await read_eof(busy)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"connection: close" in answer.lower().partition(b"\r\n\r\n")[0], answer[:200]
    with trio.fail_after(10):
        assert await read_eof(idle) == b""
        await served.wait()
    for stream in (busy, idle):
        await stream.aclose()


async def test_a_connection_queued_after_accepting_stopped_is_answered(
        config, nursery, monkeypatch):
    """Staged at the one moment where only the backlog can hold it: the shutdown trigger
    has returned and the accept loop is gone, the socket file is about to be removed (the
    server's `os.unlink` of it, wrapped), and a client connects then and sends its request.
    The kernel queues the connection, no accept loop will take it, and the listener closes
    next: the server accepts it from the backlog and answers it (`connection: close`), the
    connection is not reset. Before: trio's accept loop had closed the listener already
    (the connect refused; had the client connected sooner, a reset)."""
    real_unlink, queued = os.unlink, []

    def unlink(path, *args, **kwargs):
        if os.fspath(path) == str(config.socket_path) and not queued:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            try:  # into the backlog: nothing accepts any more
                client.connect(os.fspath(path))
                client.sendall(HEAD)
            except OSError as exc:  # the listener is closed already
                client.close()
                queued.append(exc)
            else:
                queued.append(client)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    app, stop, served = await serve_until_stopped(nursery, config)
    app.stop()
    stop.set()
    with trio.fail_after(10):
        await served.wait()
    assert queued, "the server did not remove its socket file on the way out"
    client = queued[0]
    assert isinstance(client, socket.socket), f"the client could not connect: {client!r}"
    answer = b""
    while data := client.recv(65536):  # the server has returned: the answer is in the buffer
        answer += data
    client.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"connection: close" in answer.lower().partition(b"\r\n\r\n")[0], answer[:200]


async def test_a_shutdown_does_not_wait_for_ever_on_a_client_that_does_not_read(
        config, nursery, monkeypatch):
    """A follower whose client has stopped reading (its socket buffers full, the runner's
    write blocked): at shutdown that write is given up after a short grace and the server
    returns. Before stop 56 the write was shielded without a bound and the runner never
    stopped (100 such followers: `motor serve` still running 60 s after SIGTERM)."""
    import socket

    from motor.records import Output

    fake, shutdown, done, sending = FakeRunner(config), trio.Event(), trio.Event(), trio.Event()

    async def events(job_id: str, from_seq: int = 0):
        for seq in range(1_000_000):
            sending.set()  # one event is more than a socket's buffers hold: its write blocks
            yield Output(seq=seq, stream="stdout", data="x" * (4 << 20))

    monkeypatch.setattr(fake, "events", events)

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        await serve_api(make_app(fake), config, shutdown_trigger=shutdown.wait,
                        task_status=task_status)
        done.set()

    await nursery.start(serve)
    sock = trio.socket.socket(socket.AF_UNIX)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(str(config.socket_path))
    await sock.send(b"GET /v1/jobs/j/events HTTP/1.1\r\nhost: m\r\n\r\n")
    await sending.wait()  # then it reads no more
    shutdown.set()
    with trio.fail_after(20):
        await done.wait()
    sock.close()


async def test_a_request_sent_while_the_runners_loop_was_held_past_the_idle_deadline_is_answered(
        config, nursery, short_timeout):
    """Eight times, two kept connections each send a request while the event loop is held
    (a disk stall, SIGSTOP) past their idle deadline. Before stop 57 the expired timers and
    the readers ran in one batch, in either order at each stall (trio reverses a batch half
    the time), and when the timers went first the connections were closed with their
    requests unread (through `motor serve`: 3 of 6 stalls of 8 s were reset); now an idle
    deadline that finds a request unread waits STALL_GRACE_S."""
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    answers = []
    for _ in range(8):
        socks = []
        for _ in range(2):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(config.socket_path))
            sock.sendall(HEAD)
            answer = await trio.to_thread.run_sync(response_head, sock)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            socks.append(sock)
        for sock in socks:  # the loop is held from here (this task blocks it) ...
            sock.sendall(HEAD)
        time.sleep(config.head_timeout_s + 0.3)  # ... past every idle deadline
        answers += [(await trio.to_thread.run_sync(response_head, s))[:12] for s in socks]
        for sock in socks:
            sock.close()
    assert answers == [b"HTTP/1.1 200"] * 16
