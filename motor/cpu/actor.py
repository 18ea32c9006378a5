"""The CPU actor: owns the placement state (which job holds which CPUs).

On start it registers the recorded CPU sets of jobs that are still setting up or running,
read from the store, so a restarted runner (or a restarted actor) counts them again before
placing anything new (scheduling.md: "Recorded CPU sets of jobs still running are
registered again after a runner restart").
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import trio

import actors

from .core import CpuPlacement, RateLimitedWarning
from .topology import Topology

log = logging.getLogger("motor.cpu")


@dataclass(frozen=True)
class Place:
    job_id: str
    claim: int


@dataclass(frozen=True)
class Release:
    job_id: str


@dataclass(frozen=True)
class KeepOnly:
    """Release every placement but those of `job_ids` (the jobs recorded as setting up or
    running). A restarted dispatcher sends it before it recovers: a start it had placed and
    not yet recorded when it crashed holds CPUs no job will release (an admitted job was
    never recorded at all). Reply: the job ids released, sorted."""
    job_ids: frozenset


@dataclass(frozen=True)
class Snapshot:
    """Reply: {"allowed": [...], "kept_back": [...], "jobs": {job_id: [cpus]}}."""


def slot_lock_held(path: str) -> bool:
    """Whether another process holds the Windows slot's lock file (an flock on it).

    We try a non-blocking exclusive flock and release it at once: it fails only while
    someone else holds the lock. A missing file means no slot is active.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO: no wait
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cpu: cannot open windows slot lock %s (%s); treating the slot as active",
                    path, exc.strerror)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class CpuActor(actors.Actor):
    def __init__(self, topology: Topology, allowed: Iterable[int], kept_back: Iterable[int],
                 recorded: Callable[[], dict[str, list[int]]], *,
                 windows_cpus: Iterable[int] = (), windows_slot_lock: str | None = None,
                 slot_probe: Callable[[str], bool] = slot_lock_held):
        super().__init__(name="cpu")
        self.topology = topology
        self.allowed = tuple(allowed)
        self.kept_back = tuple(kept_back)
        self.recorded = recorded
        self.windows = frozenset(windows_cpus)
        self.slot_lock = windows_slot_lock
        self.slot_probe = slot_probe
        self.warning = RateLimitedWarning(60.0)
        self.failed_open = 0
        self.placement = CpuPlacement(topology, self.allowed)

    def _avoid(self) -> frozenset[int]:
        """The Windows CPUs while the slot is active (its lock held by another process)."""
        if self.windows and self.slot_lock and self.slot_probe(self.slot_lock):
            return self.windows
        return frozenset()

    async def on_start(self):
        for job_id, cpus in self.recorded().items():
            self.placement.register(job_id, cpus)
            log.info("cpu: re-registered %s on %s", job_id, cpus)

    immediate = (Place, Release, KeepOnly, Snapshot)  # all of them: none waits

    def handle_now(self, msg):
        if isinstance(msg, Place):
            try:
                self.placement.release(msg.job_id)  # a retried start places afresh
            except KeyError:
                pass
            placement = self.placement.place(msg.job_id, msg.claim, avoid=self._avoid())
            if placement.failed_open:
                self.failed_open += 1
                if self.warning.should_warn(trio.current_time()):
                    log.warning("cpu: the windows slot is active and its CPUs cover every allowed "
                                "CPU; %s shares them (failing open, %d times so far)",
                                msg.job_id, self.failed_open)
            return list(placement.cpus)
        if isinstance(msg, Release):
            try:
                self.placement.release(msg.job_id)
            except KeyError:
                pass
            return None
        if isinstance(msg, KeepOnly):
            dropped = sorted(set(self.placement.snapshot()) - msg.job_ids)
            for job_id in dropped:
                self.placement.release(job_id)
            return dropped
        if isinstance(msg, Snapshot):
            return {
                "online": list(self.topology.online),
                "allowed": list(self.allowed),
                "kept_back": list(self.kept_back),
                "jobs": {k: list(v) for k, v in self.placement.snapshot().items()},
                "windows": sorted(self.windows),
                "windows_slot_active": bool(self._avoid()),
                "failed_open": self.failed_open,
            }
        raise TypeError(f"cpu: unknown message {msg!r}")
