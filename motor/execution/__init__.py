"""Job execution: keeperd, one long-lived keeper per state dir, or per-job keepers forked
by a forkserver (MOTOR_SPAWNER; see docs/keeper.md).

Public names are loaded lazily: the forkserver and keepers import
``motor.execution.forkserver`` / ``.keeper`` / ``.joblog`` (stdlib only) and
must not pull in trio/psutil through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "JobDirClaimed": "spawner",
    "KeeperHandle": "spawner",
    "KeeperNotStarted": "spawner",
    "Spawner": "spawner",
    "SpawnerError": "spawner",
    "cancel_keeper": "spawner",
    "kill_marked_processes": "spawner",
    "open_spawner": "spawner",
    "process_alive": "spawner",
    "wait_process_exit": "spawner",
    "JobDirError": "joblog",
    "read_keeper": "joblog",
    "read_records": "joblog",
    "read_spec": "joblog",
    "read_status": "joblog",
    "write_json_atomic": "joblog",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from motor.execution.joblog import (
        JobDirError,
        read_keeper,
        read_records,
        read_spec,
        read_status,
        write_json_atomic,
    )
    from motor.execution.spawner import (
        JobDirClaimed,
        KeeperHandle,
        KeeperNotStarted,
        Spawner,
        SpawnerError,
        cancel_keeper,
        kill_marked_processes,
        open_spawner,
        process_alive,
        wait_process_exit,
    )


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
