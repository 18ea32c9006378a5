"""The job execution actor's message and what it is built with (motor/execution/actor.py
handles the message and re-exports both)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..offload import Offload, thread_offload

if TYPE_CHECKING:
    from ..handles import (
        AccountingHandle, CpuHandle, DiskHandle, DispatcherHandle, Records, StoreHandle,
    )

__all__ = ["Cancel", "JobDeps"]


@dataclass(frozen=True)
class Cancel:
    """Reply: True when a signal was sent (or will be, once the keeper exists)."""


@dataclass(frozen=True)
class JobDeps:
    """What every job actor needs: typed handles of the other actors (motor/handles.py,
    made before the tree starts) and the shared resources. Built once, never filled in."""

    config: Any
    records: "Records"  # read-only view of job records
    store: "StoreHandle"
    dispatcher: "DispatcherHandle"
    cpu: "CpuHandle"
    accounting: "AccountingHandle"
    spawner: Any  # the execution/ports.py Keepers protocol (execution/spawner.py Spawner)
    backend: Any  # the isolation backend (motor/isolation)
    clock: Any
    jobs_dir: Path
    workspace_root: Path
    disk: "DiskHandle | None" = None  # setup admission, bundles, idle workspaces
    #: runs blocking work (execution/jobdir.py, the isolation backend) away from the event
    #: loop; None: the clock's, as for the disk actor (a worker thread; inline under
    #: MockWallClock, where a thread would let virtual time jump past every deadline)
    offload: Offload | None = None

    def __post_init__(self) -> None:
        if self.offload is None:
            object.__setattr__(self, "offload", getattr(self.clock, "offload", thread_offload))
