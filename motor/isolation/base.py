"""The Backend interface and the two backends that need no cgroups (`affinity`, `none`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any


class IsolationError(RuntimeError):
    """The requested backend cannot work on this host, or a job's group could not be made."""


@dataclass(frozen=True)
class Backend:
    """One isolation backend. The base class is the `affinity`/`none` behaviour.

    Call order for one job (see docs/isolation.md):

    - `prepare(job_id, cpus, memory_max)` before writing spec.json; its dict is merged into
      the spec. Raises `IsolationError` when the job cannot be confined (a failed start).
    - `settle(job_id, signal=...)` after the keeper exited: the OOM verdict and accounting,
      and nothing of the job left running (leftovers killed); the confinement itself stays.
      Never raises; returns `{"oom_killed", "cpu_time_ms", ...}`. The job's terminal
      record is written after it.
    - `release(job_id)` after the terminal record: remove the confinement (groups, units).
      Never raises; returns what could not be done, or None. Off the job's end path: its
      CPUs and slot are free by then (docs/isolation.md, "After the job").
    - `finish(job_id, signal=...)`: both at once (a failed start that came after `prepare`:
      its retry makes the same groups again, so they go before it).
    - `adopt(job_id)` when a runner re-adopts a job after a restart: True when the job's
      confinement is still in place.
    - `sweep(known)` once at runner start-up, before any job is adopted or started: stop
      and remove the confinement of every job not in `known` (the job ids the store
      says are setting up or running). Never raises; returns one line per thing swept.
    """

    name: str
    enforces: tuple[str, ...]  # subset of ("cpus", "memory")
    notes: tuple[str, ...] = field(default=())

    def spec_fields(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """What the keeper's spec.json needs to confine this job (no side effects here)."""
        return {"pin": "cpus" in self.enforces and bool(cpus), "cgroup_procs": []}

    def prepare(self, job_id: str, cpus: list[int] | None, memory_max: int | None) -> dict:
        """Create whatever confines the job; return the spec.json fields."""
        return self.spec_fields(job_id, cpus, memory_max)

    def settle(self, job_id: str, signal: int | None = None) -> dict:
        """After the keeper exited: OOM verdict and accounting, no process of the job left;
        the confinement stays until `release`."""
        return {"oom_killed": False, "cpu_time_ms": None}

    def settle_quick(self, job_id: str, signal: int | None = None,
                     facts: Any = None) -> dict | None:
        """`settle` in a few reads, to run on the event loop: its facts when nothing of the
        job is left to kill, None when `settle` (which may wait) must run in a thread. The
        base backend has nothing to read: `settle` itself is light (jobdir.close_is_light).
        `facts`: the keeper's own reading of them in status.json (`isolation_facts`; only
        keeperd's v1 cgroup jobs have one, see cgroup.py), for a backend that trusts it."""
        return None

    def release(self, job_id: str) -> str | None:
        """Remove the job's confinement (after its terminal record); what failed, or None."""
        return None

    def finish(self, job_id: str, signal: int | None = None) -> dict:
        """`settle`, then `release` (its error as `cleanup_error`)."""
        facts = self.settle(job_id, signal)
        if type(self).release is not Backend.release:  # a backend with something to remove
            error = self.release(job_id)
            facts["cleanup_error"] = facts.get("cleanup_error") or error
        return facts

    def adopt(self, job_id: str) -> bool:
        """Re-adoption after a runner restart: is the job's confinement still there?"""
        return True

    def sweep(self, known: set[str], owned: set[str] | None = None) -> list[str]:
        """Start-up: remove leftover confinement of jobs the store no longer knows as
        setting up or running. `owned`: the job ids this runner's state dir has a job
        directory for; confinement of any other job id (another runner's on a shared
        parent) is left alone. None: every unknown job's (tests of one backend)."""
        return []

    def parent_memory_limit(self) -> int | None:
        """The memory ceiling of all jobs together (the jobs slice), None when unlimited."""
        return None

    def spare_parents(self) -> dict[str, str] | None:
        """The parent groups, by controller, where keeperd keeps pre-placed spares for
        this backend's jobs (cgroup v1: its "prepare" fills the pool there at the runner's
        start, docs/keeper.md); None: no such pool."""
        return None

    def with_notes(self, *notes: str) -> "Backend":
        return replace(self, notes=tuple(self.notes) + tuple(n for n in notes if n))

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
