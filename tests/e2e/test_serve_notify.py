"""`motor serve` under systemd's `Type=notify` and `WatchdogSec=` (motor/runner/notify.py),
with the test as the service manager: a datagram socket named by NOTIFY_SOCKET.

A runner whose event loop is blocked is staged with the `store.commit=wait:GATE` fault: a
commit on the event loop then holds the whole loop, as a disk that never answers a
synchronous write would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, motor_env
from polling import wait_for

pytestmark = pytest.mark.e2e

WATCHDOG_S = 0.4


class Manager:
    """The service manager's end of NOTIFY_SOCKET: the messages, as they come."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.seen: list[tuple[float, str]] = []

    def read(self) -> list[str]:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return [m for _, m in self.seen]
            self.seen.extend((time.monotonic(), line) for line in data.decode().splitlines())

    def pings_since(self, t: float) -> int:
        self.read()
        return sum(1 for at, m in self.seen if m == "WATCHDOG=1" and at >= t)


@pytest.fixture
def manager(tmp_path):
    m = Manager(tmp_path / "notify.sock")
    yield m
    m.sock.close()


def test_serve_says_ready_keeps_the_watchdog_only_while_its_loop_runs_and_says_stopping(
        serve_factory, tmp_path, manager):
    gate = tmp_path / "gate"
    gate.write_text("")  # open: commits pass until it is removed
    serve = serve_factory()
    serve.env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                 "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6)),
                 "MOTOR_FAULTS": f"store.commit=wait:{gate}"}
    serve.start()
    messages = wait_for(lambda: "READY=1" in manager.read() and manager.read(), what="READY=1")
    assert messages[0] == "READY=1" and messages[1].startswith("STATUS=serving on ")
    t0 = time.monotonic()
    wait_for(lambda: manager.pings_since(t0) >= 3, what="watchdog pings")

    gate.unlink()  # the next commit holds the event loop
    reached = tmp_path / "gate.reached"
    reached.unlink(missing_ok=True)
    submit = subprocess.Popen([sys.executable, "-m", "motor", "submit", "--socket", str(serve.socket),
                               "--weight", "1", "--", "true"], env=motor_env(), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(reached.exists, what="a commit held")
    manager.read()  # what was sent before the loop was held
    held = time.monotonic()
    time.sleep(3 * WATCHDOG_S)  # three watchdog periods with the loop held
    assert manager.pings_since(held) == 0  # systemd would restart it now
    gate.write_text("")
    _, err = submit.communicate(timeout=30)
    assert submit.returncode == 0, err
    t1 = time.monotonic()
    wait_for(lambda: manager.pings_since(t1) >= 2, what="the pings to come back")

    assert serve.stop() == 0
    assert manager.read()[-1] == "STOPPING=1"


def test_no_notify_socket_sends_nothing_a_foreign_watchdog_pid_is_not_ours_and_jobs_see_neither(
        serve_factory, tmp_path, manager):
    from motor.runner.notify import notifier, watchdog_s

    assert notifier({}) is None
    assert watchdog_s({"WATCHDOG_USEC": "2000000"}) == 2.0
    assert watchdog_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_s({"WATCHDOG_USEC": "x"}) is None and watchdog_s({}) is None
    serve = serve_factory()
    serve.env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "100000",
                 "WATCHDOG_PID": "1"}  # meant for another process: no pings
    serve.start()
    wait_for(lambda: "READY=1" in manager.read(), what="READY=1")
    # a job's environment has none of systemd's variables for the runner
    ran = serve.cli("run", "--", "sh", "-c", "echo ${NOTIFY_SOCKET:-no} ${WATCHDOG_USEC:-no} ${WATCHDOG_PID:-no}")
    assert (ran.returncode, ran.stdout) == (0, b"no no no\n")
    assert "WATCHDOG=1" not in manager.read()
    assert serve.stop() == 0


def test_a_service_manager_that_reads_nothing_never_holds_the_runner(serve_factory, tmp_path):
    """PID 1 stalled: its notification socket takes datagrams until its queue is full, then
    none. The runner's sends wait on trio's socket, dropped after their bound (said once in
    the log); before stop 67 a blocking `sendto` held the event loop for good (no answer,
    SIGTERM ignored) once the queue filled: about 8 s of 10 ms pings on this host."""
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    silent.bind(str(tmp_path / "notify.sock"))  # never read
    try:
        serve = serve_factory("--isolation", "none")
        serve.env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "10000"}
        serve.start()  # pings every 5 ms: the queue fills within seconds
        wait_for(lambda: b"cannot notify the service manager" in serve.log.read_bytes(),
                 timeout=60, what="a notification dropped after its bound")
        assert serve.cli_json("health", timeout=10)["status"] in ("ok", "degraded")
        ran = serve.cli("run", "--", "echo", "still serving", timeout=30)
        assert (ran.returncode, ran.stdout) == (0, b"still serving\n"), ran.stderr
        assert serve.stop(timeout=30) == 0
        assert serve.log.read_text().count("cannot notify the service manager") == 1
    finally:
        silent.close()
