"""Stop 22's connection handling through a real `motor serve` (motor/api/server.py:
`_KeepAliveTimer`, one watcher per connection, and `protocol_send`'s writes): a kept-alive
connection is served request after request, a job submitted and followed on it, and once
idle for the request-head timeout (`--head-timeout`, 5 s by default; 2 s in these tests)
the runner closes it; a runner stopped with SIGTERM closes its idle kept-alive connections
and exits 0."""

from __future__ import annotations

import json
import socket
import time

import pytest
from socket_helpers import response_head, take_response

pytestmark = pytest.mark.e2e

#: the runners' `--head-timeout` here (the least it takes; the default is 5 s)
HEAD_TIMEOUT_S = 2.0


@pytest.fixture
def serve(serve_factory):
    return serve_factory("--head-timeout", f"{HEAD_TIMEOUT_S:g}").start()


def _request(sock: socket.socket, buf: bytearray, method: str, path: str, body: bytes = b""):
    head = (f"{method} {path} HTTP/1.1\r\nHost: motor\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    while (got := take_response(buf)) is None:
        data = sock.recv(65536)
        assert data, "the runner closed the connection before a whole answer"
        buf += data
    return int(got[0].split()[1]), json.loads(got[1])


def _eof_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the runner closes `sock` (it must send nothing more)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    assert sock.recv(65536) == b""
    return time.monotonic() - t0


def test_a_kept_alive_connection_is_served_then_closed_once_idle(serve):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(serve.socket))
        buf = bytearray()
        status, accepted = _request(sock, buf, "POST", "/v1/jobs",
                                    json.dumps({"command": ["true"]}).encode())
        assert status == 202, accepted
        for _ in range(40):  # the same connection, a request every 0.1 s until the job ends
            status, record = _request(sock, buf, "GET", f"/v1/jobs/{accepted['job_id']}")
            assert status == 200
            if record["state"] == "succeeded":
                break
            time.sleep(0.1)
        assert record["state"] == "succeeded", record
        time.sleep(HEAD_TIMEOUT_S / 2)  # idle for less than the timeout: still served
        status, health = _request(sock, buf, "GET", "/v1/health")
        assert status == 200 and health["status"] in ("ok", "degraded"), health
        idle = _eof_within(sock, HEAD_TIMEOUT_S * 6)  # then idle: closed, without an answer
        assert idle >= HEAD_TIMEOUT_S * 0.5, idle  # by the timer, not at once ...
        assert idle < 4.5, idle  # ... of --head-timeout, not of the default 5 s


def test_sigterm_closes_idle_kept_alive_connections_and_serve_exits(serve):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(serve.socket))
        status, _ = _request(sock, bytearray(), "GET", "/v1/health")
        assert status == 200
        code = serve.stop()
        assert code == 0, serve.log.read_text()[-2000:]
        _eof_within(sock, 5)



def test_requests_sent_while_the_runner_was_stopped_past_the_idle_deadline_are_answered(serve):
    """Four times: SIGSTOP past the request-head deadline, with a request sent meanwhile on
    each of 2 kept connections (a disk stall holds the loop the same way). Before stop 57
    the expired timers and the readers ran in one batch, in either order at each stall
    (trio reverses a batch half the time), and when the timers went first the connections
    were closed with their requests unread: 3 of 6 stalls in the probe."""
    import os
    import signal

    answers = []
    for _ in range(4):
        socks = []
        try:
            for _ in range(2):
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(str(serve.socket))
                sock.settimeout(30)
                assert _request(sock, bytearray(), "GET", "/v1/health")[0] == 200
                socks.append(sock)
            os.kill(serve.proc.pid, signal.SIGSTOP)
            try:
                for sock in socks:
                    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: motor\r\n\r\n")
                time.sleep(HEAD_TIMEOUT_S + 1.2)
            finally:
                os.kill(serve.proc.pid, signal.SIGCONT)
            answers += [response_head(sock)[:12] for sock in socks]
        finally:
            for sock in socks:
                sock.close()
    assert answers == [b"HTTP/1.1 200"] * 8
