"""The CPU actor: owns the placement state (which job holds which CPUs).

On start it registers the recorded CPU sets of jobs that are still setting up or running,
read from the store, so a restarted runner (or a restarted actor) counts them again before
placing anything new (scheduling.md: "Recorded CPU sets of jobs still running are
registered again after a runner restart").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import actors

from .core import CpuPlacement
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
class Snapshot:
    """Reply: {"allowed": [...], "kept_back": [...], "jobs": {job_id: [cpus]}}."""


class CpuActor(actors.Actor):
    def __init__(self, topology: Topology, allowed: Iterable[int], kept_back: Iterable[int],
                 recorded: Callable[[], dict[str, list[int]]]):
        super().__init__(name="cpu")
        self.topology = topology
        self.allowed = tuple(allowed)
        self.kept_back = tuple(kept_back)
        self.recorded = recorded
        self.placement = CpuPlacement(topology, self.allowed)

    async def on_start(self):
        for job_id, cpus in self.recorded().items():
            self.placement.register(job_id, cpus)
            log.info("cpu: re-registered %s on %s", job_id, cpus)

    async def handle(self, msg):
        if isinstance(msg, Place):
            try:
                self.placement.release(msg.job_id)  # a retried start places afresh
            except KeyError:
                pass
            return list(self.placement.place(msg.job_id, msg.claim).cpus)
        if isinstance(msg, Release):
            try:
                self.placement.release(msg.job_id)
            except KeyError:
                pass
            return None
        if isinstance(msg, Snapshot):
            return {
                "online": list(self.topology.online),
                "allowed": list(self.allowed),
                "kept_back": list(self.kept_back),
                "jobs": {k: list(v) for k, v in self.placement.snapshot().items()},
            }
        raise TypeError(f"cpu: unknown message {msg!r}")
