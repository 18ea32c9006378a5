"""Isolation backends: how a job's process tree is pinned to its CPUs and capped.

One interface, chosen at start-up (`--isolation`), reported in health:

- `affinity`: the keeper sets its own CPU affinity to the job's CPUs before spawning the
  job, so the whole process tree inherits it. Enforces the CPU set; no memory cap.
- `none`: CPU sets are chosen and recorded but nothing is pinned (fake topologies in tests).

`auto` picks the strongest backend this host supports. The `cgroup` and `systemd` backends
(CPU set plus memory cap through cgroups) are not built yet: asking for them explicitly
is a start-up error rather than a silent downgrade.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class IsolationError(RuntimeError):
    """The requested backend cannot work on this host."""


@dataclass(frozen=True)
class Backend:
    name: str
    enforces: tuple[str, ...]  # subset of ("cpus", "memory")
    notes: tuple[str, ...] = field(default=())

    def spec_fields(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """What the keeper's spec.json needs to confine this job."""
        return {"pin": "cpus" in self.enforces and bool(cpus), "cgroup_procs": []}

    def health(self) -> dict:
        return {"backend": self.name, "enforces": list(self.enforces), "notes": list(self.notes)}


AFFINITY = Backend("affinity", ("cpus",), ("memory caps need the cgroup or systemd backend",))
NONE = Backend("none", (), ("CPU sets are recorded, not enforced",))


def affinity_supported() -> bool:
    try:
        os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return False
    return True


def choose_backend(requested: str) -> Backend:
    if requested == "none":
        return NONE
    if requested in ("affinity", "auto"):
        if affinity_supported():
            return AFFINITY
        if requested == "auto":
            return NONE
        raise IsolationError("--isolation affinity: sched_setaffinity is not available here")
    raise IsolationError(f"--isolation {requested}: this backend is not available in this build")
