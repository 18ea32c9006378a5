"""The `systemd` backend: where systemd is PID 1, every job runs in a unit (a transient
scope) inside the jobs slice (`motor-jobs.slice`, the seed's slice), capped and accounted
through systemd's slices.

Per job (docs/isolation.md, "systemd"):

- A job with CPUs runs in a slot slice `motor-jobs-s<n>.slice` (a child of the jobs slice,
  by systemd's naming) that holds no other job: one job at a time, so its counters'
  growth over the job is the job's. Slot slices are started once (`StartTransientUnit`)
  and kept from job to job; `prepare` takes a free one that carries the job's limits
  already when there is one (no D-Bus call), else the lowest free one and gives it the
  job's limits, `MemoryMax=` (the claim's memory_max, already clamped to the jobs slice)
  and `AllowedCPUs=` (the job's CPU set), over D-Bus (`SetUnitProperties`), and reads
  the slice's counters (CPU time, OOM kills, limit hits) into the spec (`systemd_base`).
  A job without CPUs gets a slice of its own, `motor-jobs-j<hex>.slice`.
- keeperd hands a job with CPUs to its slot's spare, a process of keeperd's in a scope of
  the slot slice (`motor-jobs-s<n>-p<pid>.scope`, started once per slot), which spawns
  the job there: no unit per job (motor/execution/slotspares.py; `spec_fields` marks a
  slot's scope `slot`; the slots made at the runner's start, `make_slots`, get theirs
  then). Otherwise (a slot with no spare yet, a job without CPUs, the per-job
  keeper) keeperd (or the keeper's join step, motor/isolation/join.py) asks systemd for
  the job's transient scope `motor-jobs-j<hex>.scope` in that slice with the job's
  process (`StartTransientUnit`, `PIDs=`; what `systemd-run --scope` does for itself,
  without starting a program per job), before the job's first instruction, so the whole
  process tree is born in the unit. systemd drops the scope with its last process. The
  keeper (or keeperd, or the spare) also pins the job (affinity, inherited by the tree):
  `AllowedCPUs=` needs the unified cpuset controller, which hybrid (cgroup v1) hosts lack.
- `settle` takes the job's CPU time and OOM verdict as the growth of its slot slice's
  counters over the job (`job_figures`), with no D-Bus call when the job left nothing
  behind (`settle_quick`, on the event loop; a spare is not the job's); a process left
  there gets the scope that holds it stopped (the job's, or the spare's), which kills it.
  A job in a slice of its own: systemd's own summary of that slice (`CPUUsageNSec`,
  `ControlGroup`), then `release` stops the slice.
- `adopt` (after a runner restart) asks whether the job's scope (or own slice) is active,
  or finds a process with the job's marker in the jobs slice;
  `settle` of an adopted job reads the counters before it from its spec.json.

The D-Bus client is jeepney (message marshalling) over a blocking
Unix socket: as root, the manager's private socket `/run/systemd/private` (what systemctl
uses; no bus daemon needed), else the system bus. The backend's methods run in worker
threads; each operation borrows an idle connection from a small pool (`ConnectionPool`)
and waits for its unit jobs by their `JobRemoved` signal, not by polling.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal as _signal
import shutil
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jeepney import DBusAddress, HeaderFields, MessageType, Parser, new_method_call
from jeepney.auth import BEGIN
from jeepney.bus_messages import message_bus

from .base import Backend, IsolationError
from .cgroup import _try_read, oom_kills_v1, oom_kills_v2, usage_usec_v2

__all__ = [
    "PRIVATE_SOCKET",
    "SYSTEM_BUS_SOCKET",
    "SystemdBackend",
    "SystemdError",
    "SystemdManager",
    "cpu_mask",
    "job_figures",
    "job_slice",
    "oom_verdict",
    "slice_counters",
    "slice_group",
    "slice_ran",
    "slot_counters",
    "slot_counters_when_empty",
    "slot_slice",
    "unified_usage_usec",
    "open_systemd_backend",
    "scope_argv",
]

PRIVATE_SOCKET = "/run/systemd/private"
SYSTEM_BUS_SOCKET = "/run/dbus/system_bus_socket"
CGROUP_ROOT = "/sys/fs/cgroup"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SLICE = "org.freedesktop.systemd1.Slice"
PROPERTIES = "org.freedesktop.DBus.Properties"
#: systemd's "not set / infinity" for 64-bit unsigned properties.
UINT64_MAX = 2**64 - 1
CALL_TIMEOUT_S = 10.0
LIMIT_READ_TIMEOUT_S = 2.0
ACTIVATE_TIMEOUT_S = 10.0
POLL_S = 0.005
#: How long to wait for a job's JobRemoved signal before falling back to polling the unit's
#: state (a bus connection where systemd sends no signals).
SIGNAL_GRACE_S = 0.5
#: A pooled connection idle this long is closed (systemd's private socket sends every
#: signal to every connection: an idle one would only pile them up in PID 1).
IDLE_CLOSE_S = 1.0
UNIT_EXISTS = "org.freedesktop.systemd1.UnitExists"
NO_SUCH_UNIT = "org.freedesktop.systemd1.NoSuchUnit"

#: how long the slot `prepare_is_light` found free stays taken as free for `prepare`
#: (which follows it on the event loop at once) without reading its processes again
LIGHT_FRESH_S = 0.05
#: how long a slot slice found empty at its last job's end (`settle_quick`) is taken as
#: still empty, with those counters as the next job's baseline, without reading it again:
#: the next job of a burst (issue 14); after that the slice is read as it is then
EMPTIED_FRESH_S = 1.0
#: the scope of keeperd's spare `pid` in a slot slice (motor/execution/slotspares.py): the
#: spare is not a job's process
SPARE_SCOPE = re.compile(r"-s\d+-p(\d+)\.scope$")
_JOB_ID = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_-]{0,127}$")


class SystemdError(IsolationError):
    """The manager refused a call or could not be reached (`name` is the D-Bus error name)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


# -- pure helpers ------------------------------------------------------------------------------


def job_slice(parent: str, job_id: str) -> str:
    """The job's slice: `<parent>-j<id without dashes>.slice`.

    In systemd a dash in a slice name is a level of the hierarchy, so the job id's own
    dashes are dropped (a UUID stays unique as hex) and `parent` names the jobs slice
    without its suffix (`motor-jobs` -> `motor-jobs.slice`).
    """
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise IsolationError(f"systemd: job id {job_id!r} cannot name a unit")
    return f"{parent}-j{job_id.replace('-', '').replace('_', '')}.slice"


def job_scope(parent: str, job_id: str) -> str:
    return job_slice(parent, job_id)[: -len(".slice")] + ".scope"


def slot_slice(parent: str, slot: int) -> str:
    """A slot slice, `<parent>-s<slot>.slice`: it holds one job at a time and stays, with
    its counters, from job to job (`SystemdBackend.prepare`)."""
    return f"{parent}-s{slot}.slice"


def slice_group(name: str) -> str:
    """systemd's control group of a slice: each dash of its name is a level
    (`motor-jobs-s0.slice` -> `/motor.slice/motor-jobs.slice/motor-jobs-s0.slice`)."""
    parts = name[: -len(".slice")].split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def cpu_mask(cpus: list[int]) -> bytes:
    """A CPU set as systemd's `ay` bitmask: bit `c % 8` of byte `c // 8` is CPU c."""
    if not cpus:
        return b""
    mask = bytearray(max(cpus) // 8 + 1)
    for c in cpus:
        if c < 0:
            raise ValueError(f"negative CPU {c}")
        mask[c // 8] |= 1 << (c % 8)
    return bytes(mask)


def slice_properties(job_id: str, cpus: list[int] | None, memory_max: int | None) -> list:
    """The `a(sv)` properties of a job's transient slice."""
    props: list[tuple[str, tuple[str, Any]]] = [
        ("Description", ("s", f"motor job {job_id}")),
        ("CPUAccounting", ("b", True)),
        ("MemoryAccounting", ("b", True)),
    ]
    if memory_max is not None:
        props.append(("MemoryMax", ("t", int(memory_max))))
    if cpus:
        props.append(("AllowedCPUs", ("ay", cpu_mask(cpus))))
    return props


def slot_slice_properties(cpus: list[int], memory_max: int | None) -> list:
    """The limits a slot slice carries for its next job (`SetUnitProperties`): its CPU set
    and its memory cap (infinity when the claim has none)."""
    return [("MemoryMax", ("t", UINT64_MAX if memory_max is None else int(memory_max))),
            ("AllowedCPUs", ("ay", cpu_mask(cpus)))]


def scope_argv(systemd_run: str, scope: str, slice_name: str) -> list[str]:
    """The systemd-run command line equivalent to the keeper's join step (what motor used
    before the join step started the scope itself; kept for manual runs and debugging)."""
    return [systemd_run, "--scope", "--quiet", "--collect", f"--unit={scope}",
            f"--slice={slice_name}", "--"]


def message_length(head: bytes) -> int:
    """The length of the D-Bus message whose first 16 bytes are `head`."""
    e = "<" if head[0:1] == b"l" else ">"
    body_len, _serial, fields_len = struct.unpack_from(e + "III", head, 4)
    return 16 + fields_len + (-fields_len % 8) + body_len


def _uint(value: Any) -> int | None:
    return None if value is None or int(value) == UINT64_MAX else int(value)


# -- a small blocking D-Bus client ----------------------------------------------------------------


class SystemdManager:
    """Method calls on systemd's manager over one blocking connection (use as a context)."""

    def __init__(self, address: str | None = None, *, timeout: float = CALL_TIMEOUT_S):
        self.address = address or default_address()
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._parser = Parser()
        self._buf = bytearray()  # bytes read, not yet framed into messages
        self._serial = 0
        #: job object path -> result ("done", "failed", ...) from JobRemoved signals seen
        self._jobs_removed: dict[str, str] = {}

    # connection

    def __enter__(self) -> "SystemdManager":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.address)
            # EXTERNAL auth (the server checks SO_PEERCRED), pipelined with BEGIN as sd-bus
            # clients do: systemd's server leaves a request that arrives right behind a
            # separate BEGIN unread, so the first call would hang.
            sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode()
                         + b"\r\n" + BEGIN)
            reply = b""
            while b"\r\n" not in reply:
                data = sock.recv(1024)
                if not data:
                    raise SystemdError(f"systemd: {self.address} closed during authentication")
                reply += data
            line, _, rest = reply.partition(b"\r\n")
            if not line.startswith(b"OK "):
                raise SystemdError(f"systemd: authentication on {self.address} refused: "
                                   f"{line.strip().decode(errors='replace')}")
        except OSError as exc:
            sock.close()
            raise SystemdError(f"systemd: cannot connect to {self.address}: "
                               f"{exc.strerror or exc}") from None
        except SystemdError:
            sock.close()
            raise
        self._sock = sock
        # What came right behind the OK line is the first messages (on the private socket
        # the manager sends every connection its signals at once): framed, never dropped.
        self._buf = bytearray(rest)
        if self.address != PRIVATE_SOCKET and not self.address.endswith("/private"):
            self._call(new_method_call(message_bus, "Hello"))  # a bus daemon wants a Hello
            # The manager's private socket sends every signal to every connection; through
            # the bus daemon only subscribers get them, and only what they match.
            self._call(new_method_call(message_bus, "AddMatch", "s", (
                "type='signal',sender='org.freedesktop.systemd1',"
                "interface='org.freedesktop.systemd1.Manager',member='JobRemoved'",)))
            self.call(MANAGER_PATH, MANAGER, "Subscribe")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, message) -> tuple:
        if self._sock is None:
            self.connect()
        self._serial += 1
        serial = self._serial
        try:
            self._sock.sendall(message.serialise(serial=serial))
            while True:
                reply = self._next()
                if reply is None:
                    data = self._sock.recv(65536)
                    if not data:
                        raise SystemdError(f"systemd: {self.address} closed the connection")
                    self._buf += data
                    continue
                if reply.header.fields.get(HeaderFields.reply_serial) != serial:
                    self._note(reply)  # a signal: JobRemoved kept, the rest skipped
                    continue
                if reply.header.message_type == MessageType.error:
                    name = reply.header.fields.get(HeaderFields.error_name)
                    text = reply.body[0] if reply.body else ""
                    raise SystemdError(f"systemd: {name}: {text}", name=name)
                return reply.body
        except OSError as exc:
            self.close()
            raise SystemdError(f"systemd: call on {self.address} failed: "
                               f"{exc.strerror or exc}") from None

    def drain(self) -> bool:
        """Read what arrived while the connection sat idle (signals), without blocking;
        False when the manager closed it (the caller then opens a new one)."""
        if self._sock is None:
            return False
        try:
            self._sock.setblocking(False)
            try:
                while True:
                    data = self._sock.recv(65536)
                    if not data:
                        self.close()
                        return False
                    self._buf += data
            except BlockingIOError:
                pass
            finally:
                if self._sock is not None:
                    self._sock.settimeout(self.timeout)
            while (message := self._next()) is not None:
                self._note(message)
        except OSError:
            self.close()
            return False
        return True

    def _next(self):
        """The next whole message read, parsed; None when more bytes are needed.

        systemd's private socket sends every connection every signal (PropertiesChanged,
        UnitNew, JobNew, ...: ~35 per job). Signals other than JobRemoved are dropped by
        their frame alone, unparsed: parsing them all cost ~5 ms of CPU per job."""
        while len(self._buf) >= 16:
            n = message_length(self._buf)
            if len(self._buf) < n:
                return None
            frame = bytes(self._buf[:n])
            del self._buf[:n]
            if frame[1] == MessageType.signal.value and b"JobRemoved" not in frame:
                continue
            self._parser.add_data(frame)
            return self._parser.get_next_message()
        return None

    def _note(self, message) -> None:
        if (message.header.message_type == MessageType.signal
                and message.header.fields.get(HeaderFields.member) == "JobRemoved"
                and len(message.body) == 4):
            _id, job, _unit, result = message.body
            self._jobs_removed[job] = result
            if len(self._jobs_removed) > 256:  # others' jobs: keep the dict small
                self._jobs_removed.pop(next(iter(self._jobs_removed)))

    def wait_job(self, job: str, timeout: float = SIGNAL_GRACE_S) -> str | None:
        """Wait for systemd's JobRemoved signal of `job` (an object path returned by
        StartTransientUnit/StopUnit); return its result ("done", "failed", "canceled",
        ...), or None when no such signal came within `timeout` (the caller then falls
        back to polling the unit's state)."""
        deadline = time.monotonic() + timeout
        try:
            while job not in self._jobs_removed:
                message = self._next()
                if message is not None:
                    self._note(message)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._sock.settimeout(remaining)
                try:
                    data = self._sock.recv(65536)
                except socket.timeout:
                    return None
                finally:
                    self._sock.settimeout(self.timeout)
                if not data:
                    raise SystemdError(f"systemd: {self.address} closed the connection")
                self._buf += data
        except OSError as exc:
            self.close()
            raise SystemdError(f"systemd: waiting on {self.address} failed: "
                               f"{exc.strerror or exc}") from None
        return self._jobs_removed.pop(job)

    def call(self, path: str, interface: str, member: str, signature: str | None = None,
             body: tuple = ()) -> tuple:
        address = DBusAddress(path, bus_name=SYSTEMD, interface=interface)
        return self._call(new_method_call(address, member, signature, body))

    # the manager's API, the parts motor uses

    def version(self) -> str:
        return self.get(MANAGER_PATH, MANAGER, "Version")

    def start_transient(self, name: str, properties: list, mode: str = "fail") -> str:
        (job,) = self.call(MANAGER_PATH, MANAGER, "StartTransientUnit", "ssa(sv)a(sa(sv))",
                           (name, mode, properties, []))
        return job

    def stop(self, name: str, mode: str = "replace") -> str | None:
        """StopUnit; the stop job's object path, None when the unit is not loaded."""
        try:
            (job,) = self.call(MANAGER_PATH, MANAGER, "StopUnit", "ss", (name, mode))
        except SystemdError as exc:
            if exc.name != NO_SUCH_UNIT:
                raise
            return None
        return job

    def unit_path(self, name: str, *, load: bool = False) -> str | None:
        """The unit's object path; None when it is not loaded (unless `load`)."""
        try:
            (path,) = self.call(MANAGER_PATH, MANAGER, "LoadUnit" if load else "GetUnit", "s",
                                (name,))
        except SystemdError as exc:
            if exc.name == "org.freedesktop.systemd1.NoSuchUnit":
                return None
            raise
        return path

    def get(self, path: str, interface: str, prop: str) -> Any:
        (variant,) = self.call(path, PROPERTIES, "Get", "ss", (interface, prop))
        return variant[1]

    def active_state(self, name: str) -> str | None:
        path = self.unit_path(name)
        return None if path is None else self.get(path, UNIT, "ActiveState")


def default_address() -> str:
    """The manager's private socket for root (as systemctl does), else the system bus."""
    if os.geteuid() == 0 and os.path.exists(PRIVATE_SOCKET):
        return PRIVATE_SOCKET
    bus = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS", "")
    if bus.startswith("unix:path="):
        return bus[len("unix:path="):].split(",", 1)[0]
    return SYSTEM_BUS_SOCKET


# -- OOM from the memory controller of the slice's group ---------------------------------------------


def oom_verdict(control_group: str, signal: int | None, root: str = CGROUP_ROOT) -> dict:
    """Was the job in this slice OOM-killed? `{"oom_killed", "oom_kills", "oom_rule"}`.

    cgroup v2 memory.events counts kills hierarchically, so the slice's `oom_kill` is exact.
    cgroup v1 counts a kill only in the victim's own group (the job's scope, which systemd
    has removed by now), so there the rule is the cgroup backend's fallback: the job died
    of SIGKILL (not sent by its keeper: a timeout or cancel wins over OOM anyway) and the
    slice hit its limit (memory.failcnt > 0), or a kill counted in the slice itself.
    """
    c = slice_counters(control_group, root)
    return _oom_rule(c["oom_kills"], c["oom_v2"], bool(c["failcnt"]), signal)


def _oom_rule(kills: int | None, v2: bool, hit: bool, signal: int | None,
              over_the_job: bool = False) -> dict:
    """`oom_verdict`'s rules on a slice's kill count and whether it hit its limit: its
    totals, or (`over_the_job`, `job_figures`) their growth over one job."""
    over = ", growth over the job" if over_the_job else ""
    if v2:
        return {"oom_killed": bool(kills), "oom_kills": kills, "oom_rule": "v2 memory.events" + over}
    if kills:
        return {"oom_killed": True, "oom_kills": kills, "oom_rule": "v1 memory.oom_control" + over}
    return {"oom_killed": hit and signal == _signal.SIGKILL, "oom_kills": kills,
            "oom_rule": "v1: SIGKILL after the slice hit its limit"
                        + (" during the job" if over_the_job else "")}


def unified_usage_usec(control_group: str, root: str = CGROUP_ROOT) -> int | None:
    """The group's `usage_usec` from cgroup v2 cpu.stat (always there on v2, also in a hybrid
    host's `unified` tree that systemd keeps): the CPU time of everything that ran in it."""
    rel = control_group.lstrip("/")
    for base in (root, os.path.join(root, "unified")):
        text = _try_read(os.path.join(base, rel, "cpu.stat"))
        if text is not None:
            return usage_usec_v2(text)
    return None


def slice_counters(control_group: str, root: str = CGROUP_ROOT) -> dict:
    """The counters of a slot slice's group that a job's figures are the growth of, each None
    where the host has no such file: `usage_usec` (cgroup v2 `cpu.stat`, also in a hybrid
    host's unified tree: the counter systemd's CPUUsageNSec reads; else v1
    `cpuacct.usage`), `oom_kills` (v2 `memory.events`, counted up the hierarchy, so a kill
    in the job's scope counts here; else v1 `memory.oom_control`) with `oom_v2`, and
    `failcnt` (v1 `memory.failcnt`: how often the slice hit its limit)."""
    rel = control_group.lstrip("/")
    usage = unified_usage_usec(control_group, root)
    if usage is None:
        for hierarchy in ("cpuacct", "cpu,cpuacct"):
            text = (_try_read(os.path.join(root, hierarchy, rel, "cpuacct.usage")) or "").strip()
            if text.isdigit():
                usage = int(text) // 1000
                break
    out: dict[str, Any] = {"usage_usec": usage, "oom_kills": None, "oom_v2": False,
                           "failcnt": None}
    for base in (root, os.path.join(root, "unified")):
        text = _try_read(os.path.join(base, rel, "memory.events"))
        if text is not None and "oom_kill" in text:
            out.update(oom_kills=oom_kills_v2(text), oom_v2=True)
            return out
    group = os.path.join(root, "memory", rel)
    control = _try_read(os.path.join(group, "memory.oom_control"))
    out["oom_kills"] = oom_kills_v1(control) if control is not None else None
    fail = (_try_read(os.path.join(group, "memory.failcnt")) or "").strip()
    out["failcnt"] = int(fail) if fail.isdigit() else None
    return out


def _grew(before: dict, after: dict, key: str) -> int | None:
    a, b = after.get(key), before.get(key)
    return None if a is None or b is None else max(0, a - b)


#: the counters `slice_counters` gives, each with its type (or None)
_COUNTER_TYPES = {"usage_usec": int, "oom_kills": int, "oom_v2": bool, "failcnt": int}


def slot_counters_when_empty(scope: Any) -> dict | None:
    """keeperd at the end of a job in a slot slice (its spec's `systemd_scope` with `slot`):
    the slice's counters `settle_quick` would read, when no process is left in the slice
    (but the slot's spare); None when one is, when the slice cannot be read, or for a job
    in a slice of its own. keeperd puts them in status.json (`isolation_facts`), so that
    the runner's end of the job reads no group (issue 14)."""
    if not (isinstance(scope, dict) and scope.get("slot") is True
            and isinstance(name := scope.get("slice"), str) and name.endswith(".slice")):
        return None
    root = scope.get("cgroup_root")
    root = root if isinstance(root, str) else CGROUP_ROOT
    group = slice_group(name)
    return slice_counters(group, root) if group_pids(group, root) == [] else None


def slot_counters(facts: Any) -> dict | None:
    """status.json's `isolation_facts` when they have the shape `slot_counters_when_empty`
    gives (a file on disk: anything else is not trusted, and the slice is read instead)."""
    if not isinstance(facts, dict) or facts.keys() != _COUNTER_TYPES.keys():
        return None
    if any(v is not None and type(v) is not _COUNTER_TYPES[k] for k, v in facts.items()):
        return None
    return dict(facts)


def job_figures(before: dict, after: dict, signal: int | None) -> dict:
    """A job's CPU time and OOM verdict from its slot slice's counters before and after it
    (`slice_counters`): the growth over the job. OOM as `oom_verdict` rules, on growth: v2
    kills are exact; v1 counts a kill in the victim's own group (the job's scope, gone by
    now), so there it is a kill counted in the slice, or SIGKILL after the slice hit its
    limit during the job."""
    usec = _grew(before, after, "usage_usec")
    return {"cpu_time_ms": None if usec is None else usec // 1000,
            **_oom_rule(_grew(before, after, "oom_kills"), bool(after.get("oom_v2")),
                        bool(_grew(before, after, "failcnt")), signal, over_the_job=True)}


def slice_ran(control_group: str, root: str = CGROUP_ROOT) -> bool | None:
    """Did any process ever run in the slice? None when the host cannot tell.

    Any exec charges CPU time (v2 cpu.stat) and memory (v1 max_usage_in_bytes) to the
    group it runs in; a scope systemd refused never put a process there.
    """
    usec = unified_usage_usec(control_group, root)
    if usec is not None:
        return usec > 0
    peak = (_try_read(os.path.join(root, "memory", control_group.lstrip("/"),
                                   "memory.max_usage_in_bytes")) or "").strip()
    return int(peak) > 0 if peak.isdigit() else None


def group_pids(control_group: str, root: str = CGROUP_ROOT) -> list[int] | None:
    """The processes in the group and below it (the unified tree, a hybrid host's `unified`
    tree or v1's name=systemd tree, whichever has it), but keeperd's slot spares (each the
    pid its scope is named for, `<slot>-p<pid>.scope`); None when none can be read."""
    found = _pids_by_group(control_group, root)
    return None if found is None else [p for pids in found.values() for p in pids]


def _pids_by_group(control_group: str, root: str = CGROUP_ROOT) -> dict[str, list[int]] | None:
    """group_pids, by the name of the group (the unit) each process is in."""
    rel = control_group.lstrip("/")
    for base in (root, os.path.join(root, "unified"), os.path.join(root, "systemd")):
        top = os.path.join(base, rel)
        text = _try_read(os.path.join(top, "cgroup.procs"))
        if text is None:
            if os.path.isdir(top):  # there, but not readable: cannot tell
                return None
            continue
        found: dict[str, list[int]] = {}
        _collect_pids(top, text, found)
        return found
    return None


def _collect_pids(group: str, procs: str | None, found: dict[str, list[int]]) -> None:
    name = os.path.basename(group)
    spare = SPARE_SCOPE.search(name)
    pids = [int(p) for p in (procs or "").split()
            if p.isdigit() and not (spare and int(p) == int(spare[1]))]
    if pids:
        found[name] = pids
    try:
        subgroups = [e.path for e in os.scandir(group) if e.is_dir(follow_symlinks=False)]
    except OSError:  # removed meanwhile
        return
    for sub in subgroups:
        _collect_pids(sub, _try_read(os.path.join(sub, "cgroup.procs")), found)


def systemd_accounts_cpu(root: str = CGROUP_ROOT) -> bool:
    """Whether systemd can give a CPU figure: cgroup v2, or v1 cpuacct co-mounted with cpu."""
    return (os.path.exists(os.path.join(root, "cgroup.controllers"))
            or os.path.exists(os.path.join(root, "cpu", "cpuacct.usage")))


def unified_cpuset(root: str = CGROUP_ROOT) -> bool:
    """Whether systemd can apply AllowedCPUs= (the cpuset controller on cgroup v2)."""
    text = _try_read(os.path.join(root, "cgroup.controllers"))
    return text is not None and "cpuset" in text.split()


# -- the backend -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SystemdBackend(Backend):
    name: str = "systemd"
    enforces: tuple[str, ...] = ("cpus", "memory")
    notes: tuple[str, ...] = field(default=())
    parent: str = "motor-jobs"
    systemd_run: str = "systemd-run"
    address: str = field(default_factory=default_address)
    cgroup_root: str = CGROUP_ROOT
    #: the last MemoryMax read by parent_memory_limit (what health reports)
    last_read: dict = field(default_factory=dict, compare=False, repr=False)
    #: slot slice -> the (cpus, memory_max) it was last given
    applied: dict = field(default_factory=dict, compare=False, repr=False)
    #: job id -> {"slice", "base"}: a prepared job in its slot slice, until `release`
    jobs: dict = field(default_factory=dict, compare=False, repr=False)
    #: slot slice -> the job that holds it, from `prepare` until its `settle`
    holders: dict = field(default_factory=dict, compare=False, repr=False)
    lock: Any = field(default_factory=threading.Lock, compare=False, repr=False)
    #: whether keeperd spawns slot jobs from its slot spares (health says)
    slot_spares: bool = False
    #: "found": (slot, limits, when), the free slot `prepare_is_light` found, for `prepare`
    light: dict = field(default_factory=dict, compare=False, repr=False)
    #: slot slice -> (counters, when): found empty at its last job's end (`settle_quick`),
    #: not taken since
    emptied: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def parent_slice(self) -> str:
        return f"{self.parent}.slice"

    #: idle connections to the manager, reused by prepare/finish/adopt (worker threads)
    pool: "ConnectionPool" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.pool is None:
            object.__setattr__(self, "pool", ConnectionPool(self.address))

    def manager(self):
        """A connection to the manager for one operation (a context): a pooled one when one
        is idle, else a new one; put back after the operation, dropped after an error."""
        return self.pool.connection()

    def spec_fields(self, job_id: str, cpus: list[int] | None, memory_max: int | None,
                    slice_name: str | None = None) -> dict:
        """keeperd (or the keeper's join step, motor/isolation/join.py) starts the job's
        scope in its slice (`slice_name`, by default a slice of the job's own) for the
        job's process, then the job runs inside (no systemd-run)."""
        scope = {"address": self.address, "scope": job_scope(self.parent, job_id),
                 "slice": slice_name or job_slice(self.parent, job_id),
                 "description": f"motor job {job_id}"}
        if slice_name:  # a slot slice: keeperd's spare there may spawn the job in its scope,
            scope["slot"] = True  # and keeperd reads its counters at the job's end
            scope["cgroup_root"] = self.cgroup_root
        return {"pin": bool(cpus), "cgroup_procs": [], "systemd_scope": scope}

    def prepare(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """Give the job's slice its limits; return the spec.json fields.

        A job with CPUs runs in a slot slice (`slot_slice`), one that holds no other job:
        a free one already carrying this job's limits when there is one, else the lowest
        free one, whose limits change over D-Bus (`SetUnitProperties`), or which is started
        when new. Its counters are read now (or, within `EMPTIED_FRESH_S` of its last job's
        end, taken as they were then: `settle_quick`), so that the job's figures are their
        growth (`systemd_base` in the spec, for a restarted runner). A job without CPUs gets a
        slice of its own, stopped by `release`. Idempotent; raises IsolationError when
        systemd refuses.
        """
        if not cpus:
            fields = self.spec_fields(job_id, cpus, memory_max)
            with self.manager() as m:
                _start_slice(m, fields["systemd_scope"]["slice"],
                             slice_properties(job_id, cpus, memory_max))
            return fields
        limits = (tuple(sorted(cpus)), memory_max)
        with self.lock:  # prepares of two jobs in worker threads never take one slot
            name, ready = self._take_slot(job_id, limits)
        group = slice_group(name)
        emptied = self._emptied(name, job_id)
        self.emptied.pop(name, None)  # taken: the next job's baseline is read or this job's end
        if not ready:
            self.applied.pop(name, None)
            try:
                with self.manager() as m:
                    _set_slot_slice(m, name, cpus, memory_max)
            except BaseException:
                self._vacate(name, job_id)
                raise
            self.applied[name] = limits
        base = emptied if emptied is not None else slice_counters(group, self.cgroup_root)
        self.jobs[job_id] = {"slice": name, "base": base}
        fields = self.spec_fields(job_id, cpus, memory_max, name)
        fields["systemd_base"] = base
        return fields

    def _free(self, name: str, job_id: str | None = None) -> bool:
        """Whether the slot slice may take a job: no other job of this runner holds it
        (prepared, not yet settled) and no process runs in it (a job adopted after a
        restart, or something else put there)."""
        holder = self.holders.get(name)
        return ((holder is None or holder == job_id)
                and group_pids(slice_group(name), self.cgroup_root) in ([], None))

    def _emptied(self, name: str, job_id: str | None = None) -> dict | None:
        """The counters of a slot slice found empty at its last job's end, when that was
        within `EMPTIED_FRESH_S` and no job holds it since: free, and its counters as they
        were, without a read (a slot's next job in a burst). None: read it."""
        found = self.emptied.get(name)
        if (found is None or time.monotonic() - found[1] >= EMPTIED_FRESH_S
                or self.holders.get(name) not in (None, job_id)):
            return None
        return found[0]

    def _ready(self, limits: tuple, job_id: str | None = None) -> str | None:
        """A free slot slice that carries these limits already, and whose group is there.
        The one `prepare_is_light` just found (within `LIGHT_FRESH_S`, the same turn of the
        event loop in practice) is not read again, only checked for a holder."""
        light = self.light.pop("found", None)
        if light is not None:
            name, carried_for, at = light
            if (carried_for == limits and time.monotonic() - at < LIGHT_FRESH_S
                    and self.applied.get(name) == limits
                    and self.holders.get(name) in (None, job_id)):
                return name
        for name, carried in sorted(self.applied.items()):
            if carried == limits and (self._emptied(name, job_id) is not None or (
                    self._group_exists(slice_group(name)) and self._free(name, job_id))):
                return name
        return None

    def _take_slot(self, job_id: str, limits: tuple) -> tuple[str, bool]:
        """The job's slot slice, now held by it, and whether it carries its limits."""
        # list() copies in one C call: `_vacate` (the event loop) may delete meanwhile
        for held in [n for n, holder in list(self.holders.items()) if holder == job_id]:
            self.holders.pop(held, None)  # an earlier prepare of this job, never settled
        name = self._ready(limits, job_id)
        ready = name is not None
        slot = 0
        while name is None:
            if self._free(slot_slice(self.parent, slot), job_id):
                name = slot_slice(self.parent, slot)
            slot += 1
        self.holders[name] = job_id
        return name, ready

    def prepare_is_light(self, cpus: list[int] | None, memory_max: int | None) -> bool:
        """Whether `prepare` needs no D-Bus call for such a job (so it may run on the event
        loop): a free slot slice carries its limits already, from a job before."""
        if not cpus:
            return False
        limits = (tuple(sorted(cpus)), memory_max)
        name = self._ready(limits)
        if name is None:
            return False
        self.light["found"] = (name, limits, time.monotonic())  # for the `prepare` next
        return True

    def make_slots(self, slots: list[tuple[list[int], int | None]]) -> tuple[list[dict], list[str]]:
        """The runner's start (before any job): slot slice `i` made, or given its limits,
        for `slots[i]` (CPUs, memory_max), so that the first jobs find their slots ready
        (docs/isolation.md, "Slots made at the start"). A slot that is not free (a job
        adopted after a restart runs there) is left as it is. Returns the slots' scopes for
        keeperd's "prepare" (it makes its spares there) and what could not be made, each
        a line for the log: a slot that is not made is made by its first job, as before."""
        scopes: list[dict] = []
        problems: list[str] = []
        for slot, (cpus, memory_max) in enumerate(slots):
            name = slot_slice(self.parent, slot)
            with self.lock:
                if not self._free(name):
                    continue
                self.holders[name] = ""  # no job's: taken while its limits change
            try:
                with self.manager() as m:
                    _set_slot_slice(m, name, cpus, memory_max)
            except Exception as exc:  # noqa: BLE001 - logged; the slot's first job tries again
                problems.append(f"slot slice {name}: {exc}")
                continue
            else:
                self.applied[name] = (tuple(sorted(cpus)), memory_max)
                scopes.append({"address": self.address, "slice": name, "slot": True})
            finally:
                self.holders.pop(name, None)
        return scopes, problems

    def _group_exists(self, group: str) -> bool:
        rel = group.lstrip("/")
        return any(os.path.isdir(os.path.join(self.cgroup_root, h, rel))
                   for h in ("", "unified", "memory", "systemd"))

    def needs_spec(self, job_id: str) -> bool:
        """Whether `settle` wants the job's spec.json: a job this runner did not prepare (it
        was adopted after a restart) keeps its slice's counters there."""
        return job_id not in self.jobs

    def _entry(self, job_id: str, spec: dict | None) -> dict | None:
        entry = self.jobs.get(job_id)
        if entry is None and spec and isinstance(spec.get("systemd_base"), dict):
            name = (spec.get("systemd_scope") or {}).get("slice")
            if isinstance(name, str) and name != job_slice(self.parent, job_id):
                entry = self.jobs[job_id] = {"slice": name, "base": spec["systemd_base"]}
        return entry

    def settle_quick(self, job_id: str, signal: int | None = None,
                     facts: Any = None) -> dict | None:
        """`settle` on the event loop for a job in its slot slice that left no process there:
        a few reads of the slice's group, no D-Bus; none when keeperd read them (`facts`:
        status.json's `isolation_facts`, `slot_counters_when_empty`). The counters after the
        job are the next job's baseline if it comes soon (`emptied`). None (the full `settle`,
        in a thread) otherwise."""
        entry = self.jobs.get(job_id)
        if entry is None:
            return None
        name = entry["slice"]
        after = slot_counters(facts)
        if after is None:
            if group_pids(slice_group(name), self.cgroup_root) != []:
                return None
            after = slice_counters(slice_group(name), self.cgroup_root)
        facts = self._figures(job_id, entry, signal, after)
        if self.holders.get(name) == job_id:  # empty now: the next job's baseline (`prepare`)
            self.emptied[name] = (after, time.monotonic())
        self._vacate(name, job_id)
        return facts

    def _vacate(self, name: str, job_id: str) -> None:
        """The job is settled: its slot slice may take the next job (before `release`)."""
        if self.holders.get(name) == job_id:
            self.holders.pop(name, None)

    def _figures(self, job_id: str, entry: dict, signal: int | None,
                 after: dict | None = None) -> dict:
        if after is None:
            after = slice_counters(slice_group(entry["slice"]), self.cgroup_root)
        facts: dict[str, Any] = {"oom_killed": False, "cpu_time_ms": None, "cleanup_error": None}
        facts.update(job_figures(entry["base"], after, signal))
        if facts["cpu_time_ms"] is not None and after["usage_usec"] == entry["base"]["usage_usec"]:
            facts["start_error"] = (f"systemd did not start the job's scope in {entry['slice']}; "
                                    "the keeper's status says why")
        return facts

    def settle(self, job_id: str, signal: int | None = None, spec: dict | None = None) -> dict:
        """The job's figures and OOM verdict, with nothing of the job left running.

        A job in its slot slice: the growth of the slice's counters over the job
        (`job_figures`); a process left in the slice (one that escaped the job's process
        group), or a group that cannot be read, gets the job's scope stopped: systemd kills
        what is left, before the terminal record. Anything still there after that is not
        this job's (another unit put in the slice): it is left alone, and the slot is not
        taken again while a process runs there. A job in a slice of its
        own: systemd's summary of that slice (it stays for `release` when nothing runs in
        it). Never raises: problems are reported in `collect_error` / `cleanup_error`."""
        entry = self._entry(job_id, spec)
        if entry is None:
            return self._settle_own_slice(job_id, signal)
        try:
            facts = self._figures(job_id, entry, signal)
            left = _pids_by_group(slice_group(entry["slice"]), self.cgroup_root)
            if left != {}:  # the job's scope, or the slot spare's it was born in
                stem = entry["slice"].removesuffix(".slice")
                own = job_scope(self.parent, job_id)
                names = [own] if left is None else [
                    name for name in left if name == own or (
                        name.startswith(stem + "-p") and SPARE_SCOPE.search(name))]
                with self.manager() as m:
                    for name in names:
                        _stop(m, name)
            return facts
        except Exception as exc:  # noqa: BLE001 - accounting never blocks the terminal record
            return {"oom_killed": False, "cpu_time_ms": None,
                    "cleanup_error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._vacate(entry["slice"], job_id)

    def _settle_own_slice(self, job_id: str, signal: int | None) -> dict:
        facts: dict[str, Any] = {"oom_killed": False, "cpu_time_ms": None, "cleanup_error": None}
        try:
            name = job_slice(self.parent, job_id)
        except IsolationError as exc:
            facts["cleanup_error"] = str(exc)
            return facts
        try:
            with self.manager() as m:
                path = m.unit_path(name)
                if path is None:
                    return facts
                group = None
                try:
                    usage = _uint(m.get(path, SLICE, "CPUUsageNSec"))
                    facts["cpu_time_ms"] = None if usage is None else usage // 1_000_000
                    group = m.get(path, SLICE, "ControlGroup")
                    if group:
                        facts.update(oom_verdict(group, signal, self.cgroup_root))
                        if usage is None:  # systemd has no figure: the kernel's for the group
                            usec = unified_usage_usec(group, self.cgroup_root)
                            facts["cpu_time_ms"] = None if usec is None else usec // 1000
                        if slice_ran(group, self.cgroup_root) is False:
                            facts["start_error"] = (
                                f"systemd did not start the job's scope in {name}; "
                                "the keeper's status says why")
                except SystemdError as exc:
                    facts["collect_error"] = str(exc)
                if not group or group_pids(group, self.cgroup_root) != []:
                    _stop(m, name)  # leftovers (or no way to tell): killed before the record
        except Exception as exc:  # noqa: BLE001 - accounting never blocks the terminal record
            facts["cleanup_error"] = f"{type(exc).__name__}: {exc}"
        return facts

    def release_is_light(self, job_id: str) -> bool:
        """A job in its slot slice has nothing to remove (its scope went with its last
        process; the slice stays for the next job): no thread hop."""
        return job_id in self.jobs

    def release(self, job_id: str) -> str | None:
        """A job in its slot slice: forget its counters (the slice stays). A job in a slice
        of its own: stop the slice (settled: nothing of the job runs in it) and wait until
        systemd dropped it. Never raises."""
        if self.jobs.pop(job_id, None) is not None:
            return None
        try:
            name = job_slice(self.parent, job_id)
            with self.manager() as m:
                if m.unit_path(name) is not None:  # else stopped already (leftovers) or gone
                    _stop(m, name)
        except IsolationError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    def sweep(self, known: set[str], owned: set[str] | None = None) -> list[str]:
        """Stop every job unit (`<parent>-j*.slice` and `<parent>-j*.scope`) whose job the
        store does not know (and, given `owned`, that is a job of this state dir). The slot
        slices stay. Never raises."""
        def units(job_ids):
            names = set()
            for job_id in job_ids:
                try:
                    names.update((job_slice(self.parent, job_id), job_scope(self.parent, job_id)))
                except IsolationError:
                    continue
            return names

        keep = units(known)
        mine = None if owned is None else units(owned)
        swept: list[str] = []
        patterns = [f"{self.parent}-j*.slice", f"{self.parent}-j*.scope"]
        try:
            with self.manager() as m:
                (listed,) = m.call(MANAGER_PATH, MANAGER, "ListUnitsByPatterns", "asas",
                                   ([], patterns))
                for unit in sorted(listed):
                    name = unit[0]
                    if name in keep:
                        continue
                    if mine is not None and name not in mine:
                        swept.append(f"unit {name}: left alone (not a job of this state dir)")
                        continue
                    try:
                        m.stop(name)
                        swept.append(f"unit {name}: stopped")
                    except SystemdError as exc:
                        swept.append(f"unit {name}: cannot stop: {exc}")
        except Exception as exc:  # noqa: BLE001 - start-up must go on
            swept.append(f"cannot list {' '.join(patterns)} units: {exc}")
        return swept

    def adopt(self, job_id: str) -> bool:
        """After a restart: the job's scope (or its own slice) is still active, or (a job a
        slot spare spawned) a process of the job's runs in a slot spare's scope."""
        try:
            with self.manager() as m:
                if any(m.active_state(name) == "active" for name in
                       (job_scope(self.parent, job_id), job_slice(self.parent, job_id))):
                    return True
        except IsolationError:
            return False
        marker = f"MOTOR_JOB_ID={job_id}".encode()
        for pids in (_pids_by_group(slice_group(self.parent_slice), self.cgroup_root)
                     or {}).values():
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if marker in f.read().split(b"\0"):
                            return True
                except OSError:
                    continue
        return False

    def parent_memory_limit(self) -> int | None:
        # A blocking D-Bus read: start-up makes it, then maintenance in a worker thread, with
        # a short timeout; a failure keeps the last reading (motor.memory.host.read_ceiling).
        with SystemdManager(self.address, timeout=LIMIT_READ_TIMEOUT_S) as m:
            path = m.unit_path(self.parent_slice, load=True)
            limit = None if path is None else _uint(m.get(path, SLICE, "MemoryMax"))
        self.last_read["memory_max"] = limit
        return limit

    def health(self) -> dict:
        """Never calls systemd (health and /metrics run on the event loop): memory_max is
        the jobs slice's MemoryMax as last read, None before any read succeeded."""
        out = super().health()
        out["parent"] = self.parent_slice
        out["address"] = self.address
        out["memory_max"] = self.last_read.get("memory_max")
        out["slot_spares"] = self.slot_spares
        return out


class ConnectionPool:
    """Idle connections to systemd's manager, so a job's prepare and finish do not each pay
    a connect and authentication (a few ms while systemd is busy). One operation uses a
    connection at a time; a connection that saw an error is closed, not pooled; one idle
    for IDLE_CLOSE_S is closed by a janitor thread (systemd's private socket sends every
    signal to every connection, so an idle one would pile them up)."""

    def __init__(self, address: str, idle_close_s: float = IDLE_CLOSE_S):
        self.address = address
        self.idle_close_s = idle_close_s
        self._lock = threading.Lock()
        self._idle: list[tuple[SystemdManager, float]] = []
        self._janitor: threading.Thread | None = None
        self.opened = 0  # connections made (tests, bench)

    @contextlib.contextmanager
    def connection(self):
        m = self._take()
        ok = False
        try:
            yield m
            ok = True
        finally:
            if ok and m._sock is not None:
                self._give(m)
            else:
                m.close()

    def _take(self) -> SystemdManager:
        while True:
            with self._lock:
                m = self._idle.pop()[0] if self._idle else None
            if m is None:
                m = SystemdManager(self.address)
                m.connect()
                self.opened += 1
                return m
            if m.drain():  # else: closed by the manager; try the next one
                return m

    def _give(self, m: SystemdManager) -> None:
        with self._lock:
            self._idle.append((m, time.monotonic()))
            if self._janitor is None:
                self._janitor = threading.Thread(target=self._sweep, name="systemd-pool",
                                                 daemon=True)
                self._janitor.start()

    def _sweep(self) -> None:
        while True:
            time.sleep(self.idle_close_s / 2)
            now = time.monotonic()
            with self._lock:
                stale = [m for m, t in self._idle if now - t >= self.idle_close_s]
                self._idle = [(m, t) for m, t in self._idle if now - t < self.idle_close_s]
                done = not self._idle
                if done:  # a later _give starts a new janitor
                    self._janitor = None
            for m in stale:
                m.close()
            if done:
                return

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for m, _ in idle:
            m.close()


def _start_slice(m: SystemdManager, name: str, properties: list) -> None:
    """Start a transient slice and wait until it is active. The common case: one
    StartTransientUnit, then the start job's JobRemoved signal (no state polling). A slice
    left by an earlier attempt makes systemd answer UnitExists: cleared, then started again."""
    try:
        job = m.start_transient(name, properties)
    except SystemdError as exc:
        if exc.name != UNIT_EXISTS:
            raise
        job = _replace_leftover(m, name, properties)
    result = m.wait_job(job)
    if result is None:  # no signal on this connection: poll the state
        deadline = time.monotonic() + ACTIVATE_TIMEOUT_S
        while (state := m.active_state(name)) != "active":
            if state == "failed" or time.monotonic() > deadline:
                result = f"state {state}"
                break
            time.sleep(POLL_S)
        else:
            result = "done"
    if result != "done":
        m.stop(name)
        raise IsolationError(f"systemd: slice {name} did not start ({result})")


def _set_slot_slice(m: SystemdManager, name: str, cpus: list[int], memory_max: int | None) -> None:
    """Give a slot slice these limits: `SetUnitProperties` (runtime) when it is active, else
    start it with them (and CPU and memory accounting)."""
    limits = slot_slice_properties(cpus, memory_max)
    if m.active_state(name) == "active":
        m.call(MANAGER_PATH, MANAGER, "SetUnitProperties", "sba(sv)", (name, True, limits))
        return
    _start_slice(m, name, [("Description", ("s", "motor jobs, one at a time")),
                           ("CPUAccounting", ("b", True)),
                           ("MemoryAccounting", ("b", True))] + limits)


def _replace_leftover(m: SystemdManager, name: str, properties: list) -> str:
    """A slice of this name is still loaded (an earlier attempt of the job): stop it (or
    reset it when failed), wait until systemd dropped it, then start the new one."""
    deadline = time.monotonic() + ACTIVATE_TIMEOUT_S
    while True:
        state = m.active_state(name)
        if state not in (None, "inactive", "failed"):
            _stop(m, name)
            state = m.active_state(name)
        if state == "failed":  # a failed unit stays loaded until reset
            m.call(MANAGER_PATH, MANAGER, "ResetFailedUnit", "s", (name,))
        try:
            return m.start_transient(name, properties)
        except SystemdError as exc:
            if exc.name != UNIT_EXISTS or time.monotonic() > deadline:
                raise
        time.sleep(POLL_S)  # inactive, not yet unloaded


def _stop(m: SystemdManager, name: str) -> None:
    """Stop the unit (systemd kills what runs in it, then removes it); its stop job's
    JobRemoved says it is done, else poll until it is gone."""
    job = m.stop(name)
    if job is None or m.wait_job(job, ACTIVATE_TIMEOUT_S) is None:
        _wait_gone(m, name)


def _wait_gone(m: SystemdManager, name: str, timeout: float = ACTIVATE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while m.active_state(name) not in (None, "inactive", "failed"):
        if time.monotonic() > deadline:
            raise IsolationError(f"systemd: {name} did not stop within {timeout:.0f} s")
        time.sleep(POLL_S)


def open_systemd_backend(parent: str = "motor-jobs", *, address: str | None = None,
                         cgroup_root: str = CGROUP_ROOT) -> SystemdBackend:
    """Prove the manager answers; return the backend. (No systemd-run is needed: the
    keeper starts each job's scope itself, motor/isolation/join.py.)"""
    run = shutil.which("systemd-run") or "systemd-run"
    address = address or default_address()
    with SystemdManager(address) as m:
        version = m.version()
    spares = slot_spares_on()
    if spares:
        notes = [f"systemd {version}: each job in a slot slice ({parent}-s<n>.slice, one job "
                 f"at a time) under {parent}.slice, born in the scope of keeperd's spare for "
                 f"the slot ({parent}-s<n>-p<pid>.scope, started once); a job in a slot with no "
                 "spare yet and a job without CPUs in a scope of its own (docs/isolation.md, "
                 "'Slot spares')"]
    else:
        notes = [f"systemd {version}: each job in a scope of its own, started by the keeper "
                 f"(StartTransientUnit, PIDs=the job), in a slot slice ({parent}-s<n>.slice, "
                 f"one job at a time) under {parent}.slice (no slot spares: "
                 f"{SLOT_SPARES_ENV}=0, or the per-job keeper)"]
    if not unified_cpuset(cgroup_root):
        notes.append("AllowedCPUs= needs the cgroup v2 cpuset controller (absent here): "
                     "CPUs are enforced by affinity")
    if _try_read(os.path.join(cgroup_root, "cgroup.controllers")) is None:
        notes.append("cgroup v1 memory: MemoryMax= caps RAM only; swap is not capped; an OOM "
                     "kill is SIGKILL after the job's slice hit its limit")
    if not systemd_accounts_cpu(cgroup_root):
        source = ("the slice's cpu.stat in the unified tree"
                  if os.path.isdir(os.path.join(cgroup_root, "unified"))
                  else "the keeper's rusage of the job tree")
        notes.append("systemd has no CPU figure here (cgroup v1 cpu and cpuacct are separate "
                     f"hierarchies): CPU time is {source}")
    return SystemdBackend(notes=tuple(notes), parent=parent, systemd_run=run, address=address,
                          cgroup_root=cgroup_root, slot_spares=spares)


#: motor/execution/slotspares.py ENABLE_ENV (keeperd reads it; not imported here: the spare
#: is run by path and must not load this module's D-Bus client)
SLOT_SPARES_ENV = "MOTOR_KEEPERD_SLOT_SPARES"


def slot_spares_on(environ=os.environ) -> bool:
    """Whether keeperd will spawn slot jobs from slot spares: keeperd is the spawner
    (MOTOR_SPAWNER) and the spares are not turned off."""
    return (environ.get("MOTOR_SPAWNER", "keeperd") in ("", "keeperd")
            and environ.get(SLOT_SPARES_ENV, "1").strip() != "0")
