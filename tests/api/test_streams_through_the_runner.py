"""Event streams of the real runner (embedded: its store, keeperd and a job's real output)
served by the real HTTP server on a Unix socket, with clients that leave or stop reading."""

from __future__ import annotations

import fcntl
import socket
import termios

import trio

import motor
from motor.api import make_app, serve_api
from motor.records import JobRequest
from runner_helpers import embedded_config


async def test_a_follower_that_leaves_mid_replay_ends_the_runners_replay(
        tmp_path, short_dir, nursery):
    """A job's 20 MB of stored output, a client that reads the response's head and closes
    (Ctrl-C on `motor attach`): the runner's replay ends there. Counted in the store's
    reads: before stop 56 the runner went on reading all of it, slice after slice (1 MiB
    each), for nobody; now it stops within the slices it was sending."""
    config = embedded_config(tmp_path, socket=str(short_dir / "m.sock"))
    async with motor.open_runner(config) as runner:
        job = await runner.submit(JobRequest(command=[
            "sh", "-c", "yes 0123456789abcdef | head -c 20000000"], workspace="w", weight_hint=1))
        async for _ in runner.events(job.job_id):  # all of it stored
            pass
        reads, ended = [0], trio.Event()
        events_from, unfollow = runner.db.events_from, runner.hub.unfollow

        def counting(*args, **kw):
            reads[0] += 1
            return events_from(*args, **kw)

        def noting(job_id):
            unfollow(job_id)
            ended.set()

        runner.db.events_from, runner.hub.unfollow = counting, noting
        await nursery.start(serve_api, make_app(runner), config)
        sock = trio.socket.socket(socket.AF_UNIX)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(config.socket)
        await sock.send(f"GET /v1/jobs/{job.job_id}/events HTTP/1.1\r\nhost: m\r\n\r\n".encode())
        assert (await sock.recv(4096)).startswith(b"HTTP/1.1 200")
        sock.close()
        with trio.fail_after(30):
            await ended.wait()
        assert reads[0] <= 3, reads  # the whole replay reads 20 slices and more
        nursery.cancel_scope.cancel()


def test_sigterm_stops_serve_while_a_follower_reads_nothing(serve_factory):
    """`motor serve` with a follower whose client stopped reading (the runner's write to it
    blocked on full socket buffers): SIGTERM still stops it, that connection given up after
    a short grace. Before stop 56 the write was shielded without a bound and serve never
    stopped."""
    import signal

    serve = serve_factory("--isolation", "affinity").start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            "yes 0123456789abcdef | head -c 20000000")["job_id"]
    assert serve.cli("attach", job_id, timeout=120).returncode == 0  # all of it stored
    sock = socket.socket(socket.AF_UNIX)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(str(serve.socket))
    sock.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nhost: m\r\n\r\n".encode())
    from polling import wait_for

    # the runner's writes have filled what the socket holds for this client (the kernel
    # counts it here as bytes waiting to be read): its next write blocks
    wait_for(lambda: _queued(sock) >= 100_000, what="the follower's socket to fill")
    serve.proc.send_signal(signal.SIGTERM)
    try:
        assert serve.proc.wait(timeout=30) == 0
    finally:
        sock.close()


def _queued(sock: socket.socket) -> int:
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")


