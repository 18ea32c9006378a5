"""The `cgroup` backend: a group per job under a motor parent group that plays the jobs slice.

Two flavours behind one interface (`CgroupBackend`):

- v1 (`CgroupV1`): writable v1 hierarchies for cpuset, memory and cpuacct, e.g.
  `/sys/fs/cgroup/{cpuset,memory,cpuacct}`. Parent `motor-jobs` in each, a group per job
  `motor-jobs/job-<job_id>` in each. cpuset.cpus/mems, memory.limit_in_bytes; accounting
  from cpuacct.usage; OOM kills from memory.oom_control (`oom_kill N`).
- v2 (`CgroupV2`): `/sys/fs/cgroup` is a unified hierarchy with the cpuset and memory
  controllers available. Parent `/sys/fs/cgroup/motor-jobs` (controllers enabled through
  cgroup.subtree_control), a group per job below it. cpuset.cpus, memory.max; accounting
  from cpu.stat usage_usec; OOM kills from memory.events `oom_kill`.

The keeper joins the group itself: it writes its own pid into every path of
`spec["cgroup_procs"]` before spawning the job, so the whole job tree is born inside.
On v1 the runner's backend (`keeper_makes_groups`, set by motor/runner/host.py) makes no
group: `prepare` puts the groups and limits in the spec (`cgroup_make`) and the keeper
makes them; keeperd renames the groups of a spare thread that joined them ahead of
time instead, and the thread spawns the job (motor/execution/spares.py), so no migration
is left on the job's start.

Every failure to create or write a group raises `IsolationError` naming the path and the
error (the job actor treats it as a failed start). `finish()` never raises.
"""

from __future__ import annotations

import errno
import os
import re
import signal as _signal
import time
from dataclasses import dataclass, field
from typing import Any

from ..smallfiles import read_bytes
from .base import Backend, IsolationError
from .join import JoinError, rmdir_retry, write_knob

__all__ = [
    "CGROUP_ROOT",
    "PARENT",
    "CgroupBackend",
    "CgroupV1",
    "CgroupV2",
    "detect",
    "open_cgroup_backend",
    "group_name",
    "parse_keyed",
    "oom_kills_v1",
    "oom_kills_v2",
    "usage_usec_v2",
    "parse_limit",
    "format_cpus",
]

CGROUP_ROOT = "/sys/fs/cgroup"
PARENT = "motor-jobs"
V1_CONTROLLERS = ("cpuset", "memory", "cpuacct")
#: v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages).
V1_UNLIMITED_AT = 1 << 62
#: How long finish() waits for killed leftovers to leave the group, and retries EBUSY.
DRAIN_S = 3.0
RETRY_S = 0.01

_JOB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


# -- pure parsing ------------------------------------------------------------------------------


def parse_keyed(text: str) -> dict[str, int]:
    """Parse "key value" lines (memory.oom_control, memory.events, cpu.stat, memory.stat)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out


def oom_kills_v1(oom_control: str) -> int | None:
    """`oom_kill N` from v1 memory.oom_control; None on kernels older than 4.13 (no such line)."""
    return parse_keyed(oom_control).get("oom_kill")


def oom_kills_v2(memory_events: str) -> int | None:
    """`oom_kill N` from v2 memory.events."""
    return parse_keyed(memory_events).get("oom_kill")


def usage_usec_v2(cpu_stat: str) -> int | None:
    return parse_keyed(cpu_stat).get("usage_usec")


def parse_limit(text: str) -> int | None:
    """A memory limit file (v1 memory.limit_in_bytes or v2 memory.max): None when unlimited."""
    text = text.strip()
    if text in ("", "max", "-1"):
        return None
    value = int(text)
    return None if value >= V1_UNLIMITED_AT else value


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's list format)."""
    ranges: list[str] = []
    ordered = sorted(set(int(c) for c in cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


def group_name(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise IsolationError(f"cgroup: job id {job_id!r} cannot name a cgroup")
    return f"job-{job_id}"


def clamp(memory_max: int | None, ceiling: int | None) -> int | None:
    if memory_max is None:
        return ceiling
    if ceiling is None:
        return int(memory_max)
    return min(int(memory_max), ceiling)


# -- file helpers --------------------------------------------------------------------------------


def _read(path: str) -> str:
    """The whole file (smallfiles: half the cost of `open().read()`, whose text wrapper and
    isatty probe cost ~10 us per cgroup file: 8 reads at every v1 job end)."""
    return read_bytes(path).decode()


def _try_read(path: str) -> str | None:
    try:
        return _read(path)
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    """One write(2) to a control file (no O_CREAT): errors surface here, with the path."""
    try:
        write_knob(path, value)
    except JoinError as exc:
        raise IsolationError(f"cgroup: {exc}") from None


class _ParentGone(IsolationError):
    """mkdir of a group found no parent directory (ENOENT)."""


def _mkdir(path: str) -> bool:
    """Create a group; True when it was created now, False when it already existed."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        kind = _ParentGone if exc.errno == errno.ENOENT else IsolationError
        raise kind(f"cgroup: cannot create {path}: {exc.strerror or exc}") from None


def _mkdir_job(path: str, ensure_parent) -> bool:
    """Create a job's group under a parent made once at start-up. Only when the parent is
    gone (removed by hand while the runner runs: ENOENT) is it made again, then the group."""
    try:
        return _mkdir(path)
    except _ParentGone:
        ensure_parent()
        return _mkdir(path)


def _pids(procs_path: str) -> list[int]:
    text = _try_read(procs_path)
    return [int(p) for p in text.split()] if text else []


def _group_pids(group: str) -> list[int]:
    """The tasks in `group` and in every group below it: a job running as root may make
    groups inside its own and move processes there, where the group's own `cgroup.procs`
    does not list them (before stop 57 the start-up sweep's kill missed them)."""
    pids, stack = [], [group]
    while stack:
        d = stack.pop()
        pids += _pids(os.path.join(d, "cgroup.procs"))
        try:  # a cgroup directory's link count is 2 + its subgroups (kernfs): one stat
            if os.stat(d).st_nlink != 2:
                with os.scandir(d) as entries:
                    stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            pass
    return pids


def collect_v1(dirs: dict[str, str], signal: int | None) -> dict:
    """A v1 job's facts from its groups `dirs` (controller -> group): the OOM verdict and
    kill count, CPU time, the memory limit and peak. Five reads at most, no wait."""
    usage = _try_read(os.path.join(dirs["cpuacct"], "cpuacct.usage"))
    cpu_ms = int(usage.strip()) // 1_000_000 if usage and usage.strip().isdigit() else None
    mem = dirs["memory"]
    oom = None
    kills = None
    control = _try_read(os.path.join(mem, "memory.oom_control"))
    if control is not None:
        kills = oom_kills_v1(control)
    if kills is not None:
        oom = kills > 0
    else:
        # Kernels before 4.13 have no oom_kill counter: the limit was hit and the job
        # died of SIGKILL.
        fail = _try_read(os.path.join(mem, "memory.failcnt"))
        oom = bool(fail and fail.strip().isdigit() and int(fail) > 0 and signal == _signal.SIGKILL)
    limit_text = _try_read(os.path.join(mem, "memory.limit_in_bytes"))
    peak = _try_read(os.path.join(mem, "memory.max_usage_in_bytes"))
    return {"oom_killed": oom, "oom_kills": kills, "cpu_time_ms": cpu_ms,
            "memory_max": parse_limit(limit_text) if limit_text else None,
            "memory_peak": int(peak) if peak and peak.strip().isdigit() else None}


#: the facts `collect_v1` gives, each with its type (or None)
_FACT_TYPES = {"oom_killed": bool, "oom_kills": int, "cpu_time_ms": int, "memory_max": int,
               "memory_peak": int}


def facts_when_empty_v1(dirs: dict[str, str], signal: int | None) -> dict | None:
    """keeperd at the end of a v1 job whose groups it made (`cgroup_make`): the facts
    `settle_quick` would read, when no process is left in any of the groups; None when one
    is (the runner's `settle` then kills it and reads them after). keeperd puts them in
    status.json (`isolation_facts`), so that the runner's end of the job reads no group:
    8 reads off the runner's event loop (issue 14). A `cgroup.procs` that cannot be read
    counts as empty, as `settle`'s drain counts it."""
    if any(_group_pids(d) for d in dirs.values()):
        return None
    return collect_v1(dirs, signal)


def isolation_facts(status_facts: Any) -> dict | None:
    """status.json's `isolation_facts` when they have the shape `facts_when_empty_v1` gives
    (a file on disk: anything else is not trusted, and the groups are read instead)."""
    if not isinstance(status_facts, dict) or status_facts.keys() != _FACT_TYPES.keys():
        return None
    if any(v is not None and type(v) is not _FACT_TYPES[k] for k, v in status_facts.items()):
        return None
    return dict(status_facts)


def _job_groups(parent: str) -> set[str]:
    """Job ids of the `job-<id>` groups directly under `parent` (empty when it is absent)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return set()
    return {n[4:] for n in names if n.startswith("job-") and _JOB_ID.match(n[4:])
            and os.path.isdir(os.path.join(parent, n))}


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, _signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _rmdir_retry(path: str, deadline: float) -> str | None:
    """rmdir a group, retrying EBUSY (tasks still exiting) until the deadline."""
    return rmdir_retry(path, deadline, RETRY_S)


# -- the flavours ----------------------------------------------------------------------------------


class CgroupV1:
    """v1: one directory per controller hierarchy (cpuset, memory, cpuacct)."""

    version = 1

    def __init__(self, root: str = CGROUP_ROOT, parent: str = PARENT) -> None:
        self.root = root
        self.parent = parent
        self.mounts = {c: os.path.join(root, c) for c in V1_CONTROLLERS}
        #: joined once (issue 14: a job's start and end asked for them a dozen times)
        self._parents = {c: os.path.join(self.mounts[c], parent) for c in V1_CONTROLLERS}
        self._mems: str | None = None  # the parent's cpuset.mems, read once

    # where things are
    def parent_dir(self, controller: str) -> str:
        return self._parents[controller]

    def job_dirs(self, job_id: str) -> dict[str, str]:
        name = group_name(job_id)
        return {c: os.path.join(d, name) for c, d in self._parents.items()}

    def parent_paths(self) -> list[str]:
        return [self.parent_dir(c) for c in V1_CONTROLLERS]

    def describe_parent(self) -> str:
        return os.path.join(self.root, "{" + ",".join(V1_CONTROLLERS) + "}", self.parent)

    def missing(self) -> str | None:
        """What this host lacks for the v1 flavour, None when the hierarchies are there."""
        marks = {"cpuset": "cpuset.cpus", "memory": "memory.limit_in_bytes",
                 "cpuacct": "cpuacct.usage"}
        absent = [c for c, mark in marks.items()
                  if not os.path.exists(os.path.join(self.mounts[c], mark))]
        if absent:
            return "no cgroup v1 " + ", ".join(absent) + " hierarchy under " + self.root
        unwritable = [self.mounts[c] for c in V1_CONTROLLERS if not os.access(self.mounts[c], os.W_OK)]
        if unwritable:
            return "cgroup v1 hierarchies not writable: " + ", ".join(unwritable)
        return None

    def ensure_parent(self) -> None:
        """Create (or find) and initialise the parent groups: once, when the backend opens
        (and again only if a job's mkdir finds the parent gone)."""
        self._mems = None
        for c in V1_CONTROLLERS:
            _mkdir(self.parent_dir(c))
        # A new cpuset group starts with empty cpus/mems and no task may join it until both
        # are set: initialise the parent from the hierarchy's root.
        cpuset_root, cpuset_parent = self.mounts["cpuset"], self.parent_dir("cpuset")
        for knob in ("cpuset.cpus", "cpuset.mems"):
            mine = os.path.join(cpuset_parent, knob)
            if not _read(mine).strip():
                _write(mine, _read(os.path.join(cpuset_root, knob)).strip())

    def parent_memory_limit(self) -> int | None:
        text = _try_read(os.path.join(self.parent_dir("memory"), "memory.limit_in_bytes"))
        return None if text is None else parse_limit(text)

    def exists(self, job_id: str) -> bool:
        return all(os.path.isdir(d) for d in self.job_dirs(job_id).values())

    def listed(self) -> set[str]:
        """Job ids that have a group in any of the hierarchies."""
        return {jid for c in V1_CONTROLLERS for jid in _job_groups(self.parent_dir(c))}

    def pids(self, job_id: str) -> list[int]:
        return sorted({p for d in self.job_dirs(job_id).values() for p in _group_pids(d)})

    def plan(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """The job's groups and limits, without touching them: `make` is the spec's
        `cgroup_make` (the dirs, and the writes in order: mems first, a cpuset without
        mems accepts no task), for the keeper to apply (motor/isolation/join.py) or for
        keeperd to apply to a spare group it renames (motor/execution/spares.py).
        One read of the parent's memory limit (an operator may change it while the
        runner runs)."""
        dirs = self.job_dirs(job_id)
        parent_cs = self.parent_dir("cpuset")
        if self._mems is None:
            self._mems = _read(os.path.join(parent_cs, "cpuset.mems")).strip()
        want = format_cpus(cpus) if cpus else _read(os.path.join(parent_cs, "cpuset.cpus")).strip()
        limit = clamp(memory_max, self.parent_memory_limit())
        writes = [["cpuset", "cpuset.mems", self._mems], ["cpuset", "cpuset.cpus", want],
                  ["memory", "memory.limit_in_bytes", "-1" if limit is None else str(limit)]]
        return {"procs": [os.path.join(dirs[c], "cgroup.procs") for c in V1_CONTROLLERS],
                "memory_max": limit, "cpus": want, "make": {"dirs": dirs, "writes": writes}}

    def create(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """The job's groups and limits. The parent exists (made once by `ensure_parent`
        when the backend opened); per job: 3 mkdirs and 3 writes, one read of the
        parent's memory limit (an operator may change it while the runner runs)."""
        dirs = self.job_dirs(job_id)
        for d in dirs.values():
            _mkdir_job(d, self.ensure_parent)
        made = self.plan(job_id, cpus, memory_max)
        for controller, knob, value in made["make"]["writes"]:
            _write(os.path.join(dirs[controller], knob), value)
        return made

    def parents_present(self) -> bool:
        return all(os.path.isdir(self.parent_dir(c)) for c in V1_CONTROLLERS)

    def collect(self, job_id: str, signal: int | None) -> dict:
        return collect_v1(self.job_dirs(job_id), signal)

    def drain(self, job_id: str, deadline: float) -> None:
        """SIGKILL whatever is left in the job's groups until they are empty (or the deadline)."""
        dirs = self.job_dirs(job_id).values()
        while True:
            left = sorted({p for d in dirs for p in _group_pids(d)})
            if not left or time.monotonic() >= deadline:
                return
            _kill_all(left)
            time.sleep(RETRY_S)

    def rmdirs(self, job_id: str, deadline: float) -> str | None:
        errors = [e for e in (_rmdir_retry(d, deadline) for d in self.job_dirs(job_id).values()) if e]
        return "; ".join(errors) or None

    def remove(self, job_id: str) -> str | None:
        deadline = time.monotonic() + DRAIN_S
        self.drain(job_id, deadline)
        return self.rmdirs(job_id, deadline)


class CgroupV2:
    """v2: one unified hierarchy; cpuset and memory enabled down to the job groups."""

    version = 2
    controllers = ("cpuset", "memory")

    def __init__(self, root: str = CGROUP_ROOT, parent: str = PARENT) -> None:
        self.root = root
        self.parent = parent

    def parent_dir(self) -> str:
        return os.path.join(self.root, self.parent)

    def job_dir(self, job_id: str) -> str:
        return os.path.join(self.parent_dir(), group_name(job_id))

    def parent_paths(self) -> list[str]:
        return [self.parent_dir()]

    def describe_parent(self) -> str:
        return self.parent_dir()

    def missing(self) -> str | None:
        text = _try_read(os.path.join(self.root, "cgroup.controllers"))
        if text is None:
            return f"{self.root} is not a cgroup v2 (unified) hierarchy"
        absent = [c for c in self.controllers if c not in text.split()]
        if absent:
            return (f"cgroup v2 at {self.root} lacks the " + ", ".join(absent)
                    + " controller" + ("s" if len(absent) > 1 else "")
                    + f" (available: {text.strip() or 'none'})")
        if not os.access(self.root, os.W_OK):
            return f"cgroup v2 hierarchy {self.root} is not writable"
        return None

    def _enable(self, group: str) -> None:
        control = os.path.join(group, "cgroup.subtree_control")
        have = _read(control).split()
        want = [c for c in self.controllers if c not in have]
        if want:
            _write(control, " ".join("+" + c for c in want))

    def ensure_parent(self) -> None:
        self._enable(self.root)
        _mkdir(self.parent_dir())
        self._enable(self.parent_dir())

    def parent_memory_limit(self) -> int | None:
        text = _try_read(os.path.join(self.parent_dir(), "memory.max"))
        return None if text is None else parse_limit(text)

    def exists(self, job_id: str) -> bool:
        return os.path.isdir(self.job_dir(job_id))

    def listed(self) -> set[str]:
        return _job_groups(self.parent_dir())

    def pids(self, job_id: str) -> list[int]:
        return sorted(set(_group_pids(self.job_dir(job_id))))

    def create(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        d = self.job_dir(job_id)
        _mkdir_job(d, self.ensure_parent)  # the parent was made once, when the backend opened
        want = format_cpus(cpus) if cpus else ""
        _write(os.path.join(d, "cpuset.cpus"), want or "\n")  # empty = the parent's CPUs
        limit = clamp(memory_max, self.parent_memory_limit())
        _write(os.path.join(d, "memory.max"), "max" if limit is None else str(limit))
        return {"procs": [os.path.join(d, "cgroup.procs")], "memory_max": limit,
                "cpus": want or None}

    def collect(self, job_id: str, signal: int | None) -> dict:
        d = self.job_dir(job_id)
        stat = _try_read(os.path.join(d, "cpu.stat"))
        usec = usage_usec_v2(stat) if stat is not None else None
        events = _try_read(os.path.join(d, "memory.events"))
        kills = oom_kills_v2(events) if events is not None else None
        limit_text = _try_read(os.path.join(d, "memory.max"))
        peak = _try_read(os.path.join(d, "memory.peak"))
        return {"oom_killed": bool(kills), "oom_kills": kills,
                "cpu_time_ms": None if usec is None else usec // 1000,
                "memory_max": parse_limit(limit_text) if limit_text else None,
                "memory_peak": int(peak) if peak and peak.strip().isdigit() else None}

    def drain(self, job_id: str, deadline: float) -> None:
        d = self.job_dir(job_id)
        kill_file = os.path.join(d, "cgroup.kill")  # Linux 5.14+ (the groups below too)
        while True:
            left = _group_pids(d)
            if not left or time.monotonic() >= deadline:
                return
            try:
                _write(kill_file, "1")
            except IsolationError:
                _kill_all(left)
            time.sleep(RETRY_S)

    def rmdirs(self, job_id: str, deadline: float) -> str | None:
        return _rmdir_retry(self.job_dir(job_id), deadline)

    def remove(self, job_id: str) -> str | None:
        deadline = time.monotonic() + DRAIN_S
        self.drain(job_id, deadline)
        return self.rmdirs(job_id, deadline)


Flavour = CgroupV1 | CgroupV2


def detect(root: str = CGROUP_ROOT, parent: str = PARENT) -> Flavour:
    """The usable flavour on this host, or IsolationError naming what is missing."""
    v2 = CgroupV2(root, parent)
    why_not_v2 = v2.missing()
    if why_not_v2 is None:
        return v2
    v1 = CgroupV1(root, parent)
    why_not_v1 = v1.missing()
    if why_not_v1 is None:
        return v1
    unified = os.path.join(root, "unified")
    extra = ""
    if os.path.exists(os.path.join(unified, "cgroup.controllers")):
        extra = f"; {unified} has controllers: {(_try_read(os.path.join(unified, 'cgroup.controllers')) or '').strip() or 'none'}"
    raise IsolationError(f"no usable cgroups: {why_not_v2}; {why_not_v1}{extra}")


def favordynmods(mounts: str = "/proc/self/mounts") -> bool:
    """Whether a cgroup hierarchy is mounted with `favordynmods`: then a process joins a
    group without waiting for an RCU grace period (docs/isolation.md, "The join")."""
    text = _try_read(mounts) or ""
    return any(len(f) > 3 and f[2] in ("cgroup", "cgroup2") and "favordynmods" in f[3].split(",")
               for f in (line.split() for line in text.splitlines()))


def probe(flavour: Flavour) -> None:
    """Prove the parent group is writable: create it, then create and remove a test group."""
    flavour.ensure_parent()
    test_id = f"probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        flavour.create(test_id, None, None)
    finally:
        error = flavour.remove(test_id)
    if error:
        raise IsolationError(f"cgroup: probe group not removable: {error}")


@dataclass(frozen=True)
class CgroupBackend(Backend):
    name: str = "cgroup"
    enforces: tuple[str, ...] = ("cpus", "memory")
    notes: tuple[str, ...] = field(default=())
    flavour: Any = field(default=None, compare=False, repr=False)
    #: v1 only: `prepare` makes no group, it puts the groups and limits in the spec
    #: (`cgroup_make`) and the keeper makes them, keeperd from a pre-placed spare
    #: (docs/isolation.md, "The join"). The runner sets it (motor/runner/host.py).
    keeper_makes_groups: bool = False

    @property
    def version(self) -> int:
        return self.flavour.version

    @property
    def plans_only(self) -> bool:
        """`prepare` makes nothing (v1, the keeper makes the groups): three stats and one
        read, so a job's set-up may run it on the event loop (execution/jobdir.py)."""
        return self.keeper_makes_groups and self.flavour.version == 1

    def spare_parents(self) -> dict[str, str] | None:
        """v1, the keeper making the groups: the parent groups, by controller, where
        keeperd keeps its spares (its "prepare" at the runner's start fills the pool
        there, docs/keeper.md); None otherwise."""
        if not self.plans_only:
            return None
        return {c: self.flavour.parent_dir(c) for c in V1_CONTROLLERS}

    def spec_fields(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        # Side-effect free (a group made here would never be removed: only callers of
        # prepare() also call finish()). Callers must use prepare() to get the cgroups.
        return {"pin": bool(cpus), "cgroup_procs": []}

    def prepare(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """Create the job's group(s), write its limits; return the spec.json fields.

        Idempotent: an existing group for the job is reused and its limits rewritten.
        Raises IsolationError (after removing what it created) when that fails.

        With `keeper_makes_groups` (v1): no group is made here, the spec says which to
        make and what to write in them (`cgroup_make`); only a missing parent is made
        again (3 stats per job).
        """
        if self.keeper_makes_groups and self.flavour.version == 1:
            try:
                if not self.flavour.parents_present():
                    self.flavour.ensure_parent()
                made = self.flavour.plan(job_id, cpus, memory_max)
            except OSError as exc:  # a read of a parent's knob failed
                raise IsolationError(f"cgroup: cannot prepare the group for {job_id}: {exc}") from None
            return {"pin": bool(cpus), "cgroup_procs": made["procs"], "cgroup_make": made["make"]}
        try:
            made = self.flavour.create(job_id, cpus, memory_max)
        except IsolationError:
            if _JOB_ID.match(str(job_id)):
                self.flavour.remove(job_id)
            raise
        except OSError as exc:  # a read of a parent's knob failed
            self.flavour.remove(job_id)
            raise IsolationError(f"cgroup: cannot prepare the group for {job_id}: {exc}") from None
        # The keeper pins its affinity too (belt and braces) and joins every group.
        return {"pin": bool(cpus), "cgroup_procs": made["procs"]}

    def settle(self, job_id: str, signal: int | None = None) -> dict:
        """After the keeper exited: leftover tasks killed (processes that escaped the job's
        process group) until the groups are empty, then the OOM verdict and CPU time. The
        groups stay (`release` removes them). Never raises: a problem is reported in
        `collect_error` / `cleanup_error`. `signal` is status.json's signal (only used on
        kernels without an oom_kill counter)."""
        try:
            group_name(job_id)
        except IsolationError as exc:
            return {"oom_killed": False, "cpu_time_ms": None, "cleanup_error": str(exc)}
        try:
            # Leftovers first, so the CPU time read next includes them.
            self.flavour.drain(job_id, time.monotonic() + DRAIN_S)
        except Exception:
            pass
        try:
            return self.flavour.collect(job_id, signal)
        except Exception as exc:  # accounting is optional, never blocks the terminal record
            return {"oom_killed": False, "cpu_time_ms": None,
                    "collect_error": f"{type(exc).__name__}: {exc}"}

    def settle_quick(self, job_id: str, signal: int | None = None,
                     facts: Any = None) -> dict | None:
        """`settle` when the job's groups are already empty (the usual end: the keeper
        killed the job's process group): one read of each group's `cgroup.procs`, then the
        counters; 4 reads on v2, 8 on v1, no wait. None when a process is left (or collecting
        raised): `settle` runs in a thread, kills it, and reports what failed. A
        `cgroup.procs` that cannot be read counts as empty, as `settle`'s drain counts it.
        `facts`: status.json's `isolation_facts`, read by keeperd once the v1 groups it
        made were empty (`facts_when_empty_v1`): taken as they are, no group is read."""
        if facts is not None and self.flavour.version == 1 and (
                taken := isolation_facts(facts)) is not None:
            return taken
        try:
            group_name(job_id)
            if self.flavour.pids(job_id):
                return None
            return self.flavour.collect(job_id, signal)
        except Exception:  # noqa: BLE001 - the full settle reports what is wrong
            return None

    def release(self, job_id: str) -> str | None:
        """Remove the job's groups (settled: empty), retrying an EBUSY rmdir. Never raises."""
        try:
            group_name(job_id)
            return self.flavour.rmdirs(job_id, time.monotonic() + DRAIN_S)
        except IsolationError as exc:
            return str(exc)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def adopt(self, job_id: str) -> bool:
        try:
            return self.flavour.exists(job_id)
        except IsolationError:
            return False

    def sweep(self, known: set[str], owned: set[str] | None = None) -> list[str]:
        """Kill the processes of, and remove, every job group under the parent whose job
        the store does not know as setting up or running (and, given `owned`, that is a
        job of this state dir, or a probe group). Never raises."""
        swept: list[str] = []
        try:
            leftovers = sorted(self.flavour.listed() - set(known))
        except Exception as exc:  # noqa: BLE001 - start-up must go on
            return [f"cannot list the job groups under {self.flavour.describe_parent()}: {exc}"]
        if owned is not None:
            foreign = [j for j in leftovers if j not in owned and not j.startswith("probe-")]
            leftovers = [j for j in leftovers if j not in foreign]
            if foreign:
                swept.append(f"left alone: {len(foreign)} group(s) of jobs this state dir does"
                             f" not hold (another runner's?): {', '.join(foreign[:5])}")
        for job_id in leftovers:
            try:
                pids = self.flavour.pids(job_id)
                error = self.flavour.remove(job_id)
            except Exception as exc:  # noqa: BLE001
                pids, error = [], f"{type(exc).__name__}: {exc}"
            line = f"group job-{job_id}: killed {len(pids)} process(es) {pids}" if pids else \
                f"group job-{job_id}: empty"
            swept.append(line + (f"; {error}" if error else "; removed"))
        return swept

    def parent_memory_limit(self) -> int | None:
        return self.flavour.parent_memory_limit()

    def health(self) -> dict:
        out = super().health()
        out["version"] = self.flavour.version
        out["parent"] = self.flavour.describe_parent()
        out["parents"] = self.flavour.parent_paths()
        try:
            out["memory_max"] = self.parent_memory_limit()
        except (OSError, ValueError):
            out["memory_max"] = None
        return out


def open_cgroup_backend(root: str = CGROUP_ROOT, parent: str = PARENT) -> CgroupBackend:
    """Detect the flavour, prove it writable (probe group), return the backend."""
    flavour = detect(root, parent)
    try:
        probe(flavour)
    except OSError as exc:  # a knob that should be there could not be read
        raise IsolationError(f"cgroup: probe under {flavour.describe_parent()} failed: {exc}") from None
    notes = [f"cgroup v{flavour.version}: a group per job under {flavour.describe_parent()}"]
    if flavour.version == 1:
        notes.append("memory.limit_in_bytes caps RAM only; swap is not capped (memory.memsw unset)")
    if flavour.version == 1:
        notes.append("keeperd spawns a job from a spare thread already in renamed groups: "
                     "no migration on the start (docs/isolation.md, 'Spares (cgroup v1)')")
    if not favordynmods():
        notes.append(("without a spare (the per-job keeper, none ready) " if flavour.version == 1
                      else "") +
                     "a job's first process joins its group by a migration: after an idle "
                     "spell it waits an RCU grace period (10-20 ms here) unless cgroups are "
                     "mounted with favordynmods (docs/isolation.md, 'The join')")
    return CgroupBackend(notes=tuple(notes), flavour=flavour)
