"""keeperd's systemd scopes: one long-lived D-Bus connection to the manager, over which
keeperd starts each job's transient scope for the job's forked child (docs/keeper.md,
"systemd scopes").

Before, each forked child opened its own connection (connect, EXTERNAL auth, and on a bus
Hello/AddMatch/Subscribe), asked for its scope with its own pid and waited for the start
job: systemd spent 4.0-4.5 ms of CPU per scope that way, against 2.3-2.5 ms over a
connection kept open. Now keeperd keeps one connection (opened when the first scope is
asked for, reopened after it breaks), sends `StartTransientUnit` with `PIDs=[child]`
without waiting, and the replies and `JobRemoved` signals are read by keeperd's event loop
as they come: other jobs go on meanwhile. The child waits on a pipe for keeperd's word
before it execs, so the job is in its scope from its first instruction.

The only blocking step is the connection's opening (a local socket's connect and auth, and
on a bus daemon Hello/AddMatch/Subscribe), once per connection, bounded by the client's
timeout.

Stdlib plus the D-Bus client (motor/isolation/systemd.py, jeepney): keeperd imports this
module for its first systemd job only.
"""

from __future__ import annotations

import selectors
import time
from typing import Callable

from jeepney import DBusAddress, HeaderFields, MessageType, new_method_call

from motor.isolation.join import SCOPE_TIMEOUT_S  # the scope's call reply, then its JobRemoved
from motor.isolation.systemd import MANAGER, MANAGER_PATH, SYSTEMD, SystemdError, SystemdManager

__all__ = ["SCOPE_TIMEOUT_S", "ScopeStarter", "scope_properties"]

#: The bound on opening a connection (connect, auth; Hello/AddMatch/Subscribe on a bus).
CONNECT_TIMEOUT_S = 10.0

#: called once per scope: None when the scope holds the pid, else why not
Done = Callable[[str | None], None]


def scope_properties(scope: dict, pid: int) -> list:
    """The StartTransientUnit properties of a job's scope (`spec["systemd_scope"]`)."""
    return [("Description", ("s", scope.get("description") or f"motor job scope {scope['scope']}")),
            ("Slice", ("s", scope["slice"])),
            ("CollectMode", ("s", "inactive-or-failed")),
            ("PIDs", ("au", [pid]))]


class _Pending:
    __slots__ = ("name", "slice", "done", "deadline", "job")

    def __init__(self, name: str, slice_name: str, done: Done, deadline: float) -> None:
        self.name = name
        self.slice = slice_name
        self.done = done
        self.deadline = deadline
        self.job: str | None = None  # the start job's object path, once systemd answered


class _Link:
    """One open connection to one address, and the scopes asked for over it."""

    def __init__(self, address: str, timeout: float) -> None:
        self.manager = SystemdManager(address, timeout=timeout)
        self.manager.connect()  # blocking, once: connect + auth (+ Hello/Subscribe on a bus)
        self.sock = self.manager._sock
        self.sock.setblocking(False)
        self.by_serial: dict[int, _Pending] = {}
        self.by_job: dict[str, _Pending] = {}


class ScopeStarter:
    """Starts job scopes over one connection per manager address (in practice one), driven
    by keeperd's selector. `opened` counts the connections opened (tests, figures)."""

    def __init__(self, sel: selectors.BaseSelector, log: Callable[[str], None],
                 timeout: float = SCOPE_TIMEOUT_S) -> None:
        self.sel = sel
        self.log = log
        self.timeout = timeout
        self.links: dict[str, _Link] = {}
        self.opened = 0

    def start(self, scope: dict, pid: int, done: Done) -> None:
        """Ask for `scope` (a spec's `systemd_scope`) holding `pid`; `done` is called later,
        from the event loop (or at once when the call cannot even be sent)."""
        address = scope["address"]
        name, slice_name = scope["scope"], scope["slice"]
        call = new_method_call(DBusAddress(MANAGER_PATH, bus_name=SYSTEMD, interface=MANAGER),
                               "StartTransientUnit", "ssa(sv)a(sa(sv))",
                               (name, "fail", scope_properties(scope, pid), []))
        for attempt in (1, 2):
            fresh = address not in self.links
            try:
                link = self._link(address)
                link.manager._serial += 1
                serial = link.manager._serial
                data = call.serialise(serial=serial)
                # a few hundred bytes into an idle local socket; a full one: a broken manager
                sent = link.sock.send(data)
                if sent != len(data):
                    raise OSError(f"short write to the manager ({sent} of {len(data)} bytes)")
            except (SystemdError, OSError) as exc:
                if address in self.links:
                    self._drop(address, f"systemd: the connection to {address} broke: {exc}")
                if fresh or attempt == 2:  # an old connection the manager closed: once more
                    done(f"systemd did not start the job's scope {name}: {exc}")
                    return
                continue
            break
        link.by_serial[serial] = _Pending(name, slice_name, done, time.monotonic() + self.timeout)

    def deadline(self) -> float | None:
        ds = [p.deadline for link in self.links.values()
              for p in (*link.by_serial.values(), *link.by_job.values())]
        return min(ds) if ds else None

    def tick(self, now: float) -> None:
        """Fail the scopes systemd has not finished in time (never hang a job's start)."""
        for link in list(self.links.values()):
            for table in (link.by_serial, link.by_job):
                for key, p in list(table.items()):
                    if p.deadline <= now:
                        del table[key]
                        p.done(f"systemd: the start of scope {p.name} in {p.slice} did not "
                               f"finish in {self.timeout:g}s")

    def close(self) -> None:
        for address in list(self.links):
            self._drop(address, "keeperd is shutting down")

    # -- the connection ---------------------------------------------------------------

    def connect(self, address: str) -> None:
        """The connection to the manager at `address`, opened now if it is not open (a
        runner's start: keeperd's "prepare"); SystemdError or OSError when it cannot be."""
        self._link(address)

    def _link(self, address: str) -> _Link:
        link = self.links.get(address)
        if link is None:
            link = _Link(address, CONNECT_TIMEOUT_S)
            self.opened += 1
            self.links[address] = link
            self.log(f"systemd: connection {self.opened} to {address} opened")
            self.sel.register(link.sock, selectors.EVENT_READ,
                              lambda ev, a=address: self._on_readable(a))
        return link

    def _drop(self, address: str, why: str) -> None:
        """Close the connection; every scope still pending on it fails with `why` (its job
        ends spawn_failed); the next scope opens a new connection."""
        link = self.links.pop(address, None)
        if link is None:
            return
        try:
            self.sel.unregister(link.sock)
        except (KeyError, ValueError):
            pass
        link.manager.close()
        pending = [*link.by_serial.values(), *link.by_job.values()]
        if pending:
            self.log(f"{why}: {len(pending)} scope(s) failed")
        for p in pending:
            p.done(f"systemd did not start the job's scope {p.name}: {why}")

    def _on_readable(self, address: str) -> None:
        link = self.links.get(address)
        if link is None:
            return
        m = link.manager
        try:
            while True:
                data = link.sock.recv(65536)
                if not data:
                    self._drop(address, f"systemd: {address} closed the connection")
                    return
                m._buf += data
                if len(data) < 65536:
                    break
        except BlockingIOError:
            pass
        except OSError as exc:
            self._drop(address, f"systemd: reading from {address} failed: {exc}")
            return
        while (message := m._next()) is not None:
            self._on_message(link, message)

    def _on_message(self, link: _Link, message) -> None:
        fields = message.header.fields
        kind = message.header.message_type
        reply_to = fields.get(HeaderFields.reply_serial)
        if reply_to is not None and kind in (MessageType.method_return, MessageType.error):
            p = link.by_serial.pop(reply_to, None)
            if p is None:
                return
            if kind == MessageType.error:
                name = fields.get(HeaderFields.error_name)
                text = message.body[0] if message.body else ""
                p.done(f"systemd did not start the job's scope {p.name}: {name}: {text}")
                return
            (job,) = message.body
            result = link.manager._jobs_removed.pop(job, None)  # the signal came first
            if result is None:
                p.job = job
                link.by_job[job] = p
            else:
                self._finish(p, result)
            return
        if kind == MessageType.signal and fields.get(HeaderFields.member) == "JobRemoved" \
                and len(message.body) == 4:
            _id, job, _unit, result = message.body
            p = link.by_job.pop(job, None)
            if p is None:  # not ours yet (its reply may be next), or another client's
                link.manager._note(message)
            else:
                self._finish(p, result)

    def _finish(self, p: _Pending, result: str) -> None:
        if result == "done":
            p.done(None)
        else:
            p.done(f"systemd: the start of scope {p.name} in {p.slice} ended {result!r}")
