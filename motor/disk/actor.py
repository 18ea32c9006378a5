"""The disk actor: owns the free-space probe and answers admission questions."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import actors

from .core import DiskSample, admission


def probe_path(path: Path) -> DiskSample:
    usage = shutil.disk_usage(path)
    return DiskSample(free_bytes=usage.free, total_bytes=usage.total)


@dataclass(frozen=True)
class Admit:
    """Reply: a Refusal, or None when there is room."""


@dataclass(frozen=True)
class Sample:
    """Reply: the current DiskSample."""


class DiskActor(actors.Actor):
    def __init__(self, state_dir: Path, floor_bytes: int, goal_bytes: int,
                 probe: Callable[[Path], DiskSample] = probe_path):
        super().__init__(name="disk")
        self.state_dir = state_dir
        self.floor_bytes = floor_bytes
        self.goal_bytes = goal_bytes
        self.probe = probe

    async def handle(self, msg):
        if isinstance(msg, Admit):
            return admission(self.probe(self.state_dir), self.floor_bytes)
        if isinstance(msg, Sample):
            return self.probe(self.state_dir)
        raise TypeError(f"disk: unknown message {msg!r}")
