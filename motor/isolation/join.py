"""Joining a job's confinement: one call, made by the process that then spawns (or becomes)
the job, so that the job and all its descendants are born inside (docs/isolation.md).

`join_confinement(spec)` reads the spec fields an isolation backend's `prepare()` returned:

- `cgroup_procs` (the cgroup backend): the caller writes its own pid into each
  `cgroup.procs` file (one per v1 hierarchy, or the one v2 group).
- `systemd_scope` (the systemd backend): the caller asks systemd, over the manager's D-Bus
  API, for a transient scope in the job's slice with itself as its process
  (`StartTransientUnit`, `PIDs=[own pid]`), and waits for the start job to finish: what
  `systemd-run --scope` does for itself before it execs, without a second program.

Stdlib only and light to import: the per-job keeper is forked from a small forkserver that
imports this module once (motor/execution/forkserver.py). The D-Bus marshalling here covers
just the one call and the replies it needs; the runner's own D-Bus client is jeepney
(motor/isolation/systemd.py).
"""

from __future__ import annotations

import os
import struct
import time

__all__ = ["JoinError", "fork_into_cgroup", "join_cgroups", "join_confinement", "start_scope"]

#: How long the caller waits for systemd to answer and to move it into the scope.
SCOPE_TIMEOUT_S = 10.0


class JoinError(RuntimeError):
    """The caller could not be put into the job's confinement (the job must not run)."""


def join_confinement(spec: dict) -> bool:
    """Put the calling process into the job's confinement named by `spec`; True when it
    joined something (then it shares the job's groups, e.g. its memory limit)."""
    joined = False
    procs = spec.get("cgroup_procs") or ()
    if procs:
        join_cgroups(procs)
        joined = True
    scope = spec.get("systemd_scope")
    if scope:
        start_scope(scope["address"], scope["scope"], scope["slice"],
                    description=scope.get("description", ""))
        joined = True
    return joined


def join_cgroups(procs, pid: int | None = None) -> None:
    """Write `pid` (default: our own) into every `cgroup.procs` path."""
    me = str(os.getpid() if pid is None else pid).encode()
    for path in procs:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, me)
            finally:
                os.close(fd)
        except OSError as exc:
            raise JoinError(f"cannot join cgroup via {path!r}: {exc.strerror}") from None


# -- the systemd scope: one D-Bus method call, marshalled by hand ---------------------------------

_MANAGER_PATH = "/org/freedesktop/systemd1"
_MANAGER = "org.freedesktop.systemd1.Manager"
_DEST = "org.freedesktop.systemd1"
_METHOD_CALL, _METHOD_RETURN, _ERROR, _SIGNAL = 1, 2, 3, 4
# header field codes
_F_PATH, _F_INTERFACE, _F_MEMBER, _F_ERROR_NAME, _F_REPLY_SERIAL, _F_DEST, _F_SIGNATURE = \
    1, 2, 3, 4, 5, 6, 8


class _Writer:
    """D-Bus wire format, little-endian, for the few types the call needs."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def pad(self, n: int) -> None:
        self.buf += b"\0" * (-len(self.buf) % n)

    def byte(self, v: int) -> None:
        self.buf.append(v)

    def u32(self, v: int) -> None:
        self.pad(4)
        self.buf += struct.pack("<I", v)

    def string(self, v: str) -> None:  # also 'o'
        data = v.encode()
        self.u32(len(data))
        self.buf += data + b"\0"

    def signature(self, v: str) -> None:
        data = v.encode()
        self.buf.append(len(data))
        self.buf += data + b"\0"

    def array(self, align: int, items, write_item) -> None:
        self.u32(0)
        at = len(self.buf)
        self.pad(align)
        start = len(self.buf)
        for item in items:
            write_item(item)
        struct.pack_into("<I", self.buf, at - 4, len(self.buf) - start)

    def variant(self, sig: str, value) -> None:
        self.signature(sig)
        if sig in ("s", "o"):
            self.string(value)
        elif sig == "b":
            self.u32(1 if value else 0)
        elif sig == "au":
            self.array(4, value, self.u32)
        else:  # pragma: no cover - only the types above are used
            raise ValueError(sig)


def _call_message(serial: int, path: str, interface: str, member: str, dest: str,
                  signature: str, write_body) -> bytes:
    body = _Writer()
    write_body(body)
    head = _Writer()
    head.buf += b"l" + bytes((_METHOD_CALL, 0, 1))
    head.u32(len(body.buf))
    head.u32(serial)

    def field(item):
        code, sig, value = item
        head.pad(8)
        head.byte(code)
        if sig == "g":
            head.signature("g")
            head.signature(value)
        else:
            head.variant(sig, value)

    fields = [(_F_PATH, "o", path), (_F_INTERFACE, "s", interface),
              (_F_MEMBER, "s", member), (_F_DEST, "s", dest)]
    if signature:
        fields.append((_F_SIGNATURE, "g", signature))
    head.array(8, fields, field)
    head.pad(8)
    return bytes(head.buf + body.buf)


def _method_call(serial: int, member: str, signature: str, write_body) -> bytes:
    """A call on systemd's manager."""
    return _call_message(serial, _MANAGER_PATH, _MANAGER, member, _DEST, signature, write_body)


class _Reader:
    def __init__(self, data: bytes, little: bool) -> None:
        self.data, self.pos, self.e = data, 0, "<" if little else ">"

    def align(self, n: int) -> None:
        self.pos += -self.pos % n

    def u32(self) -> int:
        self.align(4)
        (v,) = struct.unpack_from(self.e + "I", self.data, self.pos)
        self.pos += 4
        return v

    def string(self) -> str:
        n = self.u32()
        v = self.data[self.pos:self.pos + n].decode(errors="replace")
        self.pos += n + 1
        return v

    def signature(self) -> str:
        n = self.data[self.pos]
        v = self.data[self.pos + 1:self.pos + 1 + n].decode()
        self.pos += n + 2
        return v


def _parse(message: bytes) -> tuple[int, dict, bytes, bool]:
    """(type, header fields we read, body, little-endian) of one whole message."""
    little = message[0:1] == b"l"
    kind = message[1]
    r = _Reader(message, little)
    r.pos = 12
    end = 16 + r.u32()
    fields: dict[int, object] = {}
    while r.pos < end:
        r.align(8)
        code = message[r.pos]
        r.pos += 1
        sig = r.signature()
        if sig in ("s", "o"):
            fields[code] = r.string()
        elif sig == "u":
            fields[code] = r.u32()
        elif sig == "g":
            fields[code] = r.signature()
        else:  # a field type we do not read: no message of interest has one
            break
    r.pos = end
    r.align(8)
    return kind, fields, message[r.pos:], little


def message_length(head: bytes) -> int:
    """The length of the D-Bus message whose first 16 bytes are `head`."""
    e = "<" if head[0:1] == b"l" else ">"
    body_len, _serial, fields_len = struct.unpack_from(e + "III", head, 4)
    return 16 + fields_len + (-fields_len % 8) + body_len


class _Conn:
    def __init__(self, address: str, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        # _socket, not socket: the forkserver that imports this module stays small (the
        # socket module's enums made every keeper fork measurably dearer), and only a
        # systemd keeper gets here
        import _socket

        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        self.buf = b""
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(address)
            # EXTERNAL auth pipelined with BEGIN, as the runner's client does (systemd.py)
            self.sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode()
                              + b"\r\nBEGIN\r\n")
            while b"\r\n" not in self.buf:
                self._more()
            line, self.buf = self.buf.split(b"\r\n", 1)
            if not line.startswith(b"OK "):
                raise JoinError(f"systemd: authentication on {address} refused: "
                                f"{line.decode(errors='replace')}")
        except BaseException:
            self.sock.close()
            raise

    def _more(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(remaining)
        data = self.sock.recv(65536)
        if not data:
            raise JoinError("systemd closed the connection")
        self.buf += data

    def next_message(self) -> tuple[int, dict, bytes, bool]:
        """The next message, parsed; signals other than JobRemoved are skipped unparsed
        (systemd's private socket sends every signal to every connection)."""
        while True:
            while len(self.buf) < 16:
                self._more()
            n = message_length(self.buf)
            while len(self.buf) < n:
                self._more()
            message, self.buf = self.buf[:n], self.buf[n:]
            if message[1] != _SIGNAL or b"JobRemoved" in message:
                return _parse(message)

    def close(self) -> None:
        self.sock.close()


def _scope_body(scope: str, slice_name: str, pid: int, description: str):
    props = [("Description", "s", description or f"motor job scope {scope}"),
             ("Slice", "s", slice_name),
             ("CollectMode", "s", "inactive-or-failed"),
             ("PIDs", "au", [pid])]

    def write(w: _Writer) -> None:
        w.string(scope)
        w.string("fail")

        def prop(item):
            name, sig, value = item
            w.pad(8)
            w.string(name)
            w.variant(sig, value)

        w.array(8, props, prop)
        w.array(8, [], None)  # no auxiliary units

    return write


def start_scope(address: str, scope: str, slice_name: str, *, pid: int | None = None,
                description: str = "", timeout: float = SCOPE_TIMEOUT_S) -> None:
    """Ask systemd for the transient scope `scope` in `slice_name` holding `pid` (default:
    the caller), and wait until its start job finished. Raises JoinError with systemd's
    own words when it refuses (e.g. the name is taken) or does not answer in time."""
    pid = os.getpid() if pid is None else pid
    try:
        conn = _Conn(address, timeout)
    except OSError as exc:
        raise JoinError(f"systemd: cannot connect to {address}: {exc.strerror or exc}") from None
    try:
        serial = 1
        if not address.endswith("/private"):  # through a bus daemon: Hello, then listen
            conn.sock.sendall(_hello(serial))
            _reply(conn, serial)
            serial += 1
            conn.sock.sendall(_add_match(serial))
            _reply(conn, serial)
            serial += 1
            conn.sock.sendall(_method_call(serial, "Subscribe", "", lambda w: None))
            _reply(conn, serial)
            serial += 1
        conn.sock.sendall(_method_call(serial, "StartTransientUnit", "ssa(sv)a(sa(sv))",
                                       _scope_body(scope, slice_name, pid, description)))
        removed: dict[str, str] = {}
        job = _reply(conn, serial, removed)
        while job not in removed:
            kind, fields, body, little = conn.next_message()
            _note_removed(kind, fields, body, little, removed)
        if removed[job] != "done":
            raise JoinError(f"systemd: the start of scope {scope} in {slice_name} ended "
                            f"{removed[job]!r}")
    except OSError as exc:
        raise JoinError(f"systemd: starting scope {scope}: {exc.strerror or exc}") from None
    finally:
        conn.close()


def _note_removed(kind, fields, body, little, removed: dict) -> None:
    if kind == _SIGNAL and fields.get(_F_MEMBER) == "JobRemoved" \
            and fields.get(_F_SIGNATURE) == "uoss":
        r = _Reader(body, little)
        r.u32()
        job, _unit, result = r.string(), r.string(), r.string()
        removed[job] = result


def _reply(conn: _Conn, serial: int, removed: dict | None = None) -> str:
    """Wait for the reply to `serial`; its first string/object argument (or ""). Signals
    that arrive meanwhile: JobRemoved noted in `removed`, the rest skipped."""
    while True:
        kind, fields, body, little = conn.next_message()
        if kind in (_METHOD_RETURN, _ERROR) and fields.get(_F_REPLY_SERIAL) == serial:
            text = ""
            if fields.get(_F_SIGNATURE, "")[:1] in ("s", "o") and body:
                text = _Reader(body, little).string()
            if kind == _ERROR:
                raise JoinError(f"systemd: {fields.get(_F_ERROR_NAME)}: {text}")
            return text
        if removed is not None:
            _note_removed(kind, fields, body, little, removed)


def _hello(serial: int) -> bytes:
    return _bus_call(serial, "Hello", "", None)


def _add_match(serial: int) -> bytes:
    rule = ("type='signal',sender='org.freedesktop.systemd1',"
            "interface='org.freedesktop.systemd1.Manager',member='JobRemoved'")
    return _bus_call(serial, "AddMatch", "s", rule)


def _bus_call(serial: int, member: str, signature: str, arg) -> bytes:
    """A call on the bus daemon itself (org.freedesktop.DBus)."""
    return _call_message(serial, "/org/freedesktop/DBus", "org.freedesktop.DBus", member,
                         "org.freedesktop.DBus", signature,
                         (lambda w: w.string(arg)) if arg is not None else (lambda w: None))


# -- cgroup v2: born inside (clone3 with CLONE_INTO_CGROUP) -----------------------------------------

#: clone3(2) (Linux 5.3; CLONE_INTO_CGROUP since 5.7). 435 on every architecture that
#: uses the generic syscall table, x86_64 included.
SYS_CLONE3 = 435
CLONE_INTO_CGROUP = 0x200000000
_CLONE_ARGS = struct.Struct("<11Q")  # struct clone_args up to .cgroup (CLONE_ARGS_SIZE_VER2)


def fork_into_cgroup(cgroup_dir: str) -> int:
    """fork(), with the child born in the cgroup v2 group `cgroup_dir`: 0 in the child, the
    child's pid in the parent (as os.fork). No migration happens, so the child never waits
    for the kernel's cgroup_threadgroup_rwsem write side (on a host without favordynmods
    the first migration after an idle spell waits an RCU grace period, 10-20 ms here).

    For a spawner that fork+execs a job (motor/execution): the child sets up its fds and
    execs. Raises OSError (ENOSYS: kernel before 5.7 or a seccomp filter; EOPNOTSUPP, EBADF:
    `cgroup_dir` is not on a cgroup v2 hierarchy; EBUSY: a group with controllers enabled
    for its children) with nothing forked; the caller may fall back to fork + join_cgroups.
    """
    import ctypes  # the forkserver has it loaded already

    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        args = ctypes.create_string_buffer(_CLONE_ARGS.pack(
            CLONE_INTO_CGROUP, 0, 0, 0, 17,  # flags, pidfd, child_tid, parent_tid, SIGCHLD
            0, 0, 0, 0, 0, fd), _CLONE_ARGS.size)  # stack, stack_size, tls, set_tid(_size)
        api = ctypes.pythonapi  # holds the GIL across the call, as os.fork does
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        api.PyOS_BeforeFork()
        pid = libc.syscall(ctypes.c_long(SYS_CLONE3), args, ctypes.c_size_t(_CLONE_ARGS.size))
        if pid == 0:
            api.PyOS_AfterFork_Child()
            return 0
        err = ctypes.get_errno()
        api.PyOS_AfterFork_Parent()
        if pid < 0:
            raise OSError(err, f"clone3 into {cgroup_dir}: {os.strerror(err)}")
        return pid
    finally:
        os.close(fd)  # in the child too (it is close-on-exec anyway)
