"""keeperd's systemd scope starter (motor/execution/sdscopes.py) against a real Unix socket
that speaks the manager's side of D-Bus (jeepney frames): the reply and the JobRemoved
signal in either order, systemd's refusal, a connection closed with a call in flight, and
a call never answered. Every path ends the scope's wait; none hangs."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest
from fake_dbus import dbus_messages
from socket_helpers import serve_each
from jeepney import DBusAddress, new_error, new_method_return, new_signal

from motor.execution.sdscopes import ScopeStarter
from motor.isolation.systemd import MANAGER, MANAGER_PATH

JOB = "/org/freedesktop/systemd1/job/7"


class Manager:
    """A listening socket named like systemd's private one (so no Hello is expected): each
    connection is authenticated, then `script(conn, call)` answers each method call."""

    def __init__(self, tmp_path, script) -> None:
        self.path = str(tmp_path / "private")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen()
        self.script = script
        self.accepted = 0
        self.calls = []
        self.thread = serve_each(self.listener, self._conn)

    def _conn(self, conn: socket.socket) -> None:
        self.accepted += 1
        with conn:  # closed however the client leaves (else a ResourceWarning at a later GC)
            self._talk(conn)

    def _talk(self, conn: socket.socket) -> None:
        for msg in dbus_messages(conn):
            self.calls.append(msg)
            if self.script(conn, msg) == "close":
                return

    def close(self) -> None:
        self.listener.close()


def scope(address: str, name: str = "motor-jobs-j1.scope") -> dict:
    return {"address": address, "scope": name, "slice": "motor-jobs-j1.slice",
            "description": "motor job 1"}


def job_removed(result: str):
    return new_signal(DBusAddress(MANAGER_PATH, interface=MANAGER), "JobRemoved", "uoss",
                      (7, JOB, "motor-jobs-j1.scope", result))


def drive(starter: ScopeStarter, sel: selectors.BaseSelector, results: list, want: int) -> None:
    """keeperd's loop, reduced: select, dispatch, tick, until `want` scopes are answered."""
    deadline = time.monotonic() + 30  # a safety net against a hang, not an assertion
    while len(results) < want:
        assert time.monotonic() < deadline, "the scope's wait never ended"
        for key, events in sel.select(1.0):
            key.data(events)
        starter.tick(time.monotonic())


@pytest.fixture
def sel():
    s = selectors.EpollSelector()
    yield s
    for key in list(s.get_map().values()):  # the starters' connections
        key.fileobj.close()
    s.close()


@pytest.mark.parametrize("signal_first", [False, True])
def test_a_scope_is_done_when_its_start_job_is_removed(tmp_path, sel, signal_first):
    def script(conn, call):
        reply = new_method_return(call, "o", (JOB,)).serialise(serial=100)
        signal = job_removed("done").serialise(serial=101)
        conn.sendall(signal + reply if signal_first else reply + signal)

    manager = Manager(tmp_path, script)
    starter = ScopeStarter(sel, lambda line: None)
    results: list = []
    for _ in range(3):
        starter.start(scope(manager.path), 4242, results.append)
        drive(starter, sel, results, len(results) + 1)
    assert results == [None, None, None]
    assert manager.accepted == starter.opened == 1  # three scopes, one connection
    call = manager.calls[0]
    assert call.header.fields[3] == "StartTransientUnit"  # member
    name, mode, props, aux = call.body
    assert (name, mode) == ("motor-jobs-j1.scope", "fail")
    assert dict(props)["PIDs"] == ("au", [4242])
    assert dict(props)["Slice"] == ("s", "motor-jobs-j1.slice")
    starter.close()
    manager.close()


def _one_scope(tmp_path, sel, script) -> str | None:
    """One scope started against a manager answering with `script`: its result."""
    manager = Manager(tmp_path, script)
    starter = ScopeStarter(sel, lambda line: None)
    results: list = []
    starter.start(scope(manager.path), 4242, results.append)
    drive(starter, sel, results, 1)
    manager.close()
    return results[0]


def test_a_failed_start_job_fails_the_scope(tmp_path, sel):
    def script(conn, call):
        conn.sendall(new_method_return(call, "o", (JOB,)).serialise(serial=100)
                     + job_removed("failed").serialise(serial=101))

    assert "ended 'failed'" in _one_scope(tmp_path, sel, script)


def test_systemds_refusal_is_the_scopes_error(tmp_path, sel):
    def script(conn, call):
        conn.sendall(new_error(call, "org.freedesktop.systemd1.UnitExists", "s",
                               ("Unit motor-jobs-j1.scope was already loaded",)).serialise(serial=9))

    result = _one_scope(tmp_path, sel, script)
    assert "did not start the job's scope motor-jobs-j1.scope" in result
    assert "UnitExists" in result and "already loaded" in result


def test_a_connection_closed_with_calls_in_flight_fails_them_and_the_next_reconnects(
        tmp_path, sel):
    answer = threading.Event()

    def script(conn, call):
        if not answer.is_set():
            return "close"  # the manager goes away with the call unanswered
        conn.sendall(new_method_return(call, "o", (JOB,)).serialise(serial=100)
                     + job_removed("done").serialise(serial=101))
        return None

    manager = Manager(tmp_path, script)
    logged: list = []
    starter = ScopeStarter(sel, logged.append)
    results: list = []
    starter.start(scope(manager.path), 4242, results.append)
    drive(starter, sel, results, 1)
    assert "closed the connection" in results[0], results
    assert any("1 scope(s) failed" in line for line in logged), logged
    answer.set()
    starter.start(scope(manager.path), 4243, results.append)
    drive(starter, sel, results, 2)
    assert results[1] is None
    assert manager.accepted == starter.opened == 2
    manager.close()


def test_a_scope_never_answered_fails_at_its_deadline(tmp_path, sel):
    manager = Manager(tmp_path, lambda conn, call: None)  # reads the call, never answers
    starter = ScopeStarter(sel, lambda line: None, timeout=0.0)
    results: list = []
    starter.start(scope(manager.path), 4242, results.append)
    assert starter.deadline() is not None and results == []
    starter.tick(starter.deadline())
    assert len(results) == 1 and "did not finish in 0s" in results[0], results
    assert starter.deadline() is None
    manager.close()


def test_an_unreachable_manager_fails_the_scope_at_once(tmp_path, sel):
    starter = ScopeStarter(sel, lambda line: None)
    results: list = []
    starter.start(scope(str(tmp_path / "nobody" / "private")), 4242, results.append)
    assert len(results) == 1 and "cannot connect" in results[0], results
    assert starter.links == {}
