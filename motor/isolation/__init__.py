"""Isolation backends: how a job's process tree is pinned to its CPUs and capped.

One interface (`Backend`), chosen at start-up (`--isolation`), reported in health
(docs/isolation.md):

- `systemd`: where systemd is PID 1, each job in a transient scope of its own, started
  over D-Bus with the job's process (keeperd, or motor/isolation/join.py), inside a slot
  slice (one job at a time, kept from job to job, carrying the job's `MemoryMax=` and
  `AllowedCPUs=`) inside the jobs slice (`motor-jobs.slice`); CPU time and OOM kills are
  the growth of the slot slice's counters over the job (`motor.isolation.systemd`).
- `cgroup`: a group per job under a motor parent group (cgroup v2, or writable v1
  cpuset/memory/cpuacct hierarchies). Enforces the CPU set and the memory cap; OOM kills
  and CPU time come from the group (`motor.isolation.cgroup`).
- `affinity`: the keeper sets its own CPU affinity to the job's CPUs before spawning the
  job, so the whole process tree inherits it. Enforces the CPU set; no memory cap.
- `none`: CPU sets are chosen and recorded but nothing is pinned (fake topologies in tests).

`auto` picks the strongest backend this host supports, in that order, and says in the
backend's notes why it skipped the stronger ones. Asking for a backend explicitly never
downgrades silently: it is a start-up error naming what the host lacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Backend

# The base names load on first use (PEP 562): the keeper's forkserver imports
# `motor.isolation.join` (stdlib only) and must not pull in dataclasses with `base`.
_BASE_NAMES = ("AFFINITY", "NONE", "Backend", "IsolationError", "affinity_supported")


def __getattr__(name: str):
    if name in _BASE_NAMES:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AFFINITY",
    "NONE",
    "Backend",
    "HostProbe",
    "IsolationError",
    "affinity_supported",
    "choose_backend",
]


class HostProbe:
    """What `choose_backend` asks the host (tests pass a fake).

    `cgroup_parent` names the group that plays the jobs slice (`--cgroup-parent`).
    """

    def __init__(self, cgroup_parent: str = "motor-jobs"):
        self.cgroup_parent = cgroup_parent

    def pid1(self) -> str:
        try:
            with open("/proc/1/comm") as f:
                return f.read().strip()
        except OSError:
            return "unknown"

    def systemd(self) -> Backend:
        """A working systemd backend (the manager answers), or IsolationError saying why not."""
        from .systemd import open_systemd_backend

        return open_systemd_backend(parent=self.cgroup_parent)

    def cgroup(self) -> Backend:
        """A working cgroup backend, or IsolationError naming what is missing."""
        from .cgroup import open_cgroup_backend

        return open_cgroup_backend(parent=self.cgroup_parent)

    def affinity(self) -> bool:
        from .base import affinity_supported

        return affinity_supported()


def choose_backend(requested: str, *, probe: HostProbe | None = None) -> Backend:
    from .base import AFFINITY, NONE, IsolationError

    probe = probe or HostProbe()
    if requested == "none":
        return NONE
    if requested == "systemd":
        pid1 = probe.pid1()
        if pid1 != "systemd":
            raise IsolationError(
                f"--isolation systemd: systemd is not PID 1 on this host (PID 1 is {pid1!r}); "
                "use --isolation cgroup")
        try:
            return probe.systemd()
        except IsolationError as exc:
            raise IsolationError(f"--isolation systemd: {exc}") from None
    if requested == "cgroup":
        try:
            return probe.cgroup()
        except IsolationError as exc:
            raise IsolationError(f"--isolation cgroup: {exc}") from None
    if requested == "affinity":
        if probe.affinity():
            return AFFINITY
        raise IsolationError("--isolation affinity: sched_setaffinity is not available here")
    if requested == "auto":
        pid1 = probe.pid1()
        if pid1 == "systemd":
            try:
                return probe.systemd()
            except IsolationError as exc:
                notes = [f"auto: systemd backend unavailable: {exc}"]
        else:
            notes = [f"auto: systemd backend skipped (PID 1 is {pid1!r}, not systemd)"]
        try:
            return probe.cgroup().with_notes(*notes)
        except IsolationError as exc:
            notes.append(f"auto: cgroup backend unavailable: {exc}")
        if probe.affinity():
            return AFFINITY.with_notes(*notes)
        notes.append("auto: sched_setaffinity is not available")
        return NONE.with_notes(*notes)
    raise IsolationError(f"--isolation {requested}: unknown backend "
                         "(auto, systemd, cgroup, affinity, none)")
