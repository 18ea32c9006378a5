"""The `systemd` backend: where systemd is PID 1, every job runs in a unit of its own inside
the jobs slice (`motor-jobs.slice`, the seed's slice), capped and accounted by systemd.

Per job (docs/isolation.md, "systemd"):

- `prepare` starts a transient slice `motor-jobs-j<hex>.slice` (a child of the jobs slice,
  by systemd's naming) with `MemoryMax=` (the claim's memory_max, already clamped to the
  jobs slice), `AllowedCPUs=` (the job's CPU set), and CPU and memory accounting, over the
  manager's D-Bus API (`StartTransientUnit`).
- The keeper starts the job through `systemd-run --scope --slice=<that slice>`: systemd
  moves the job's first process into a transient scope before it execs the command, so
  the whole process tree is in the unit; the keeper itself stays outside, so an OOM kill
  never takes the keeper. The keeper also pins itself to the CPU set before spawning
  (affinity, inherited by the tree): `AllowedCPUs=` needs the unified cpuset controller,
  which hybrid (cgroup v1) hosts lack.
- `finish` reads systemd's own summary of the slice (`CPUUsageNSec`, `ControlGroup`),
  decides OOM from the memory controller of that group (`oom_verdict`), then stops the
  slice, which kills anything the job left behind and lets systemd remove the unit.
- `adopt` (after a runner restart) asks whether the job's slice is still active.

The D-Bus client is jeepney (message marshalling) over a blocking
Unix socket: as root, the manager's private socket `/run/systemd/private` (what systemctl
uses; no bus daemon needed), else the system bus. One short connection per operation:
the backend's methods run in worker threads, one job each.
"""

from __future__ import annotations

import os
import re
import signal as _signal
import shutil
import socket
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
    "job_slice",
    "oom_verdict",
    "slice_ran",
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


def scope_argv(systemd_run: str, scope: str, slice_name: str) -> list[str]:
    """The prefix the keeper puts before the job's command (docs/isolation.md)."""
    return [systemd_run, "--scope", "--quiet", "--collect", f"--unit={scope}",
            f"--slice={slice_name}", "--"]


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
        self._serial = 0

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
            if not reply.startswith(b"OK "):
                raise SystemdError(f"systemd: authentication on {self.address} refused: "
                                   f"{reply.strip().decode(errors='replace')}")
        except OSError as exc:
            sock.close()
            raise SystemdError(f"systemd: cannot connect to {self.address}: "
                               f"{exc.strerror or exc}") from None
        except SystemdError:
            sock.close()
            raise
        self._sock = sock
        if self.address != PRIVATE_SOCKET and not self.address.endswith("/private"):
            self._call(new_method_call(message_bus, "Hello"))  # a bus daemon wants a Hello

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
                reply = self._parser.get_next_message()
                if reply is None:
                    data = self._sock.recv(65536)
                    if not data:
                        raise SystemdError(f"systemd: {self.address} closed the connection")
                    self._parser.add_data(data)
                    continue
                if reply.header.fields.get(HeaderFields.reply_serial) != serial:  # signals: skipped
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

    def stop(self, name: str, mode: str = "replace") -> None:
        try:
            self.call(MANAGER_PATH, MANAGER, "StopUnit", "ss", (name, mode))
        except SystemdError as exc:
            if exc.name != "org.freedesktop.systemd1.NoSuchUnit":
                raise

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
    rel = control_group.lstrip("/")
    for base in (root, os.path.join(root, "unified")):
        text = _try_read(os.path.join(base, rel, "memory.events"))
        if text is not None and "oom_kill" in text:
            kills = oom_kills_v2(text)
            return {"oom_killed": bool(kills), "oom_kills": kills, "oom_rule": "v2 memory.events"}
    group = os.path.join(root, "memory", rel)
    control = _try_read(os.path.join(group, "memory.oom_control"))
    kills = oom_kills_v1(control) if control is not None else None
    if kills:
        return {"oom_killed": True, "oom_kills": kills, "oom_rule": "v1 memory.oom_control"}
    fail = (_try_read(os.path.join(group, "memory.failcnt")) or "").strip()
    hit = fail.isdigit() and int(fail) > 0
    return {"oom_killed": hit and signal == _signal.SIGKILL, "oom_kills": kills,
            "oom_rule": "v1: SIGKILL after the slice hit its limit"}


def unified_usage_usec(control_group: str, root: str = CGROUP_ROOT) -> int | None:
    """The group's `usage_usec` from cgroup v2 cpu.stat (always there on v2, also in a hybrid
    host's `unified` tree that systemd keeps): the CPU time of everything that ran in it."""
    rel = control_group.lstrip("/")
    for base in (root, os.path.join(root, "unified")):
        text = _try_read(os.path.join(base, rel, "cpu.stat"))
        if text is not None:
            return usage_usec_v2(text)
    return None


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

    @property
    def parent_slice(self) -> str:
        return f"{self.parent}.slice"

    def manager(self) -> SystemdManager:
        return SystemdManager(self.address)

    def spec_fields(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        slice_name = job_slice(self.parent, job_id)
        return {"pin": bool(cpus), "cgroup_procs": [],
                "command_prefix": scope_argv(self.systemd_run, job_scope(self.parent, job_id),
                                             slice_name)}

    def prepare(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """Start the job's slice with its limits; return the spec.json fields.

        Idempotent: a slice left over from an earlier attempt is stopped (or reset) first.
        Raises IsolationError when systemd refuses.
        """
        fields = self.spec_fields(job_id, cpus, memory_max)
        name = job_slice(self.parent, job_id)
        with self.manager() as m:
            state = m.active_state(name)
            if state not in (None, "inactive", "failed"):
                m.stop(name)
                _wait_gone(m, name)
                state = m.active_state(name)
            if state == "failed":  # a failed unit stays loaded until reset
                m.call(MANAGER_PATH, MANAGER, "ResetFailedUnit", "s", (name,))
            m.start_transient(name, slice_properties(job_id, cpus, memory_max))
            deadline = time.monotonic() + ACTIVATE_TIMEOUT_S
            while (state := m.active_state(name)) != "active":
                if state == "failed" or time.monotonic() > deadline:
                    m.stop(name)
                    raise IsolationError(f"systemd: slice {name} did not start (state {state})")
                time.sleep(POLL_S)
        return fields

    def finish(self, job_id: str, signal: int | None = None) -> dict:
        """systemd's summary of the job's slice, the OOM verdict, then stop the slice.

        Never raises: problems are reported in `collect_error` / `cleanup_error`.
        """
        facts: dict[str, Any] = {"oom_killed": False, "cpu_time_ms": None, "cleanup_error": None}
        try:
            name = job_slice(self.parent, job_id)
        except IsolationError as exc:
            facts["cleanup_error"] = str(exc)
            return facts
        try:
            with self.manager() as m:
                path = m.unit_path(name)
                if path is not None:
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
                                    "systemd-run's reason is in the job's stderr")
                    except SystemdError as exc:
                        facts["collect_error"] = str(exc)
                    m.stop(name)  # kills what the job left behind; systemd removes the unit
                    _wait_gone(m, name)
        except Exception as exc:  # noqa: BLE001 - accounting never blocks the terminal record
            facts["cleanup_error"] = f"{type(exc).__name__}: {exc}"
        return facts

    def sweep(self, known: set[str], owned: set[str] | None = None) -> list[str]:
        """Stop every `<parent>-j*.slice` unit whose job the store does not know (and, given
        `owned`, that is a job of this state dir). Never raises."""
        def slices(job_ids):
            names = set()
            for job_id in job_ids:
                try:
                    names.add(job_slice(self.parent, job_id))
                except IsolationError:
                    continue
            return names

        keep = slices(known)
        mine = None if owned is None else slices(owned)
        swept: list[str] = []
        try:
            with self.manager() as m:
                (units,) = m.call(MANAGER_PATH, MANAGER, "ListUnitsByPatterns", "asas",
                                  ([], [f"{self.parent}-j*.slice"]))
                for unit in units:
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
            swept.append(f"cannot list {self.parent}-j*.slice units: {exc}")
        return swept

    def adopt(self, job_id: str) -> bool:
        try:
            with self.manager() as m:
                return m.active_state(job_slice(self.parent, job_id)) == "active"
        except IsolationError:
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
        return out


def _wait_gone(m: SystemdManager, name: str, timeout: float = ACTIVATE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while m.active_state(name) not in (None, "inactive", "failed"):
        if time.monotonic() > deadline:
            raise IsolationError(f"systemd: {name} did not stop within {timeout:.0f} s")
        time.sleep(POLL_S)


def open_systemd_backend(parent: str = "motor-jobs", *, address: str | None = None,
                         cgroup_root: str = CGROUP_ROOT) -> SystemdBackend:
    """Prove the manager answers and systemd-run exists; return the backend."""
    run = shutil.which("systemd-run")
    if run is None:
        raise IsolationError("systemd: systemd-run is not installed")
    address = address or default_address()
    with SystemdManager(address) as m:
        version = m.version()
    notes = [f"systemd {version}: a slice per job under {parent}.slice, "
             "the job in a scope (systemd-run --scope)"]
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
                          cgroup_root=cgroup_root)
