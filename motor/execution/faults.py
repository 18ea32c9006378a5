"""Fault injection at named points of a job's start and end (tests only).

Off unless the environment variable ``MOTOR_FAULT`` is set; the runner, the forkserver
and the keepers all read it (they inherit the runner's environment).

``MOTOR_FAULT="NAME[:ACTION][,NAME[:ACTION]...]"``, ACTION one of:

- ``pause`` (the default): create ``$MOTOR_FAULT_DIR/NAME.reached`` (its content is the
  pid that reached the point), then block until ``$MOTOR_FAULT_DIR/NAME.go`` exists (at
  most ``FAULT_PAUSE_MAX_S``). A test uses the pair as an explicit barrier: it waits for
  ``.reached``, does its damage (kill -9 the runner, fill the disk...), then creates ``.go``.
- ``kill``: SIGKILL the process that reached the point.

Named points (docs/keeper.md, "Start protocol"):

- ``runner_after_record``: runner, job actor, the record is saved as ``setup``, nothing
  written in the job directory yet.
- ``forkserver_after_fork``: forkserver, the keeper is forked, its identity not recorded.
- ``forkserver_after_claim``: forkserver, ``keeper.json`` (the claim) is written, the keeper
  not yet released.
- ``keeper_after_spawn``: keeper, the job is spawned, ``keeper.json`` not yet updated.
- ``keeper_before_status``: keeper, the job ended, ``status.json`` not yet written.

Stdlib only: imported by the forkserver and the keepers.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["FAULT_PAUSE_MAX_S", "active", "point"]

FAULT_PAUSE_MAX_S = 120.0
_parsed: tuple[str, dict[str, str]] | None = None


def _faults() -> dict[str, str]:
    global _parsed
    raw = os.environ.get("MOTOR_FAULT", "")
    if _parsed is None or _parsed[0] != raw:
        table: dict[str, str] = {}
        for item in raw.split(","):
            item = item.strip()
            if item:
                name, _, action = item.partition(":")
                table[name.strip()] = action.strip() or "pause"
        _parsed = (raw, table)
    return _parsed[1]


def active(name: str) -> bool:
    return bool(os.environ.get("MOTOR_FAULT")) and name in _faults()


def point(name: str) -> None:
    """Reached a named point: do what MOTOR_FAULT says for it (nothing when unset)."""
    if not os.environ.get("MOTOR_FAULT"):
        return
    action = _faults().get(name)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        return
    where = os.environ.get("MOTOR_FAULT_DIR") or "/tmp"
    reached = os.path.join(where, f"{name}.reached")
    with open(reached + f".{os.getpid()}", "w") as f:
        f.write(str(os.getpid()))
    os.replace(reached + f".{os.getpid()}", reached)
    go = os.path.join(where, f"{name}.go")
    deadline = time.monotonic() + FAULT_PAUSE_MAX_S
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
