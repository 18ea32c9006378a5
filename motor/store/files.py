"""Private state on disk: the runner's umask and the umask its jobs run with.

Everything under the state dir may hold a job's `env` (secrets the API never shows):
`motor.db`, `jobs/<id>/spec.json`, `output.log`. So the runner sets umask 077 before it
creates anything: directories it creates are 0700, files 0600; keepers inherit it (and
open their files 0600 explicitly). A state dir the operator made is left as it is.

The job itself runs with the umask the runner was started with (the operator's choice,
e.g. systemd's `UMask=`, 0022 by default): build outputs keep their usual modes.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

PRIVATE_UMASK = 0o077

_holders = 0
_operator_umask: int | None = None


@contextmanager
def private_umask() -> Iterator[int]:
    """umask 077 while the block runs (nested and concurrent runners share it);
    yields the umask jobs run with, restored when the last holder leaves."""
    global _holders, _operator_umask
    previous = os.umask(PRIVATE_UMASK)
    if _holders == 0:
        _operator_umask = previous
    _holders += 1
    try:
        yield job_umask()
    finally:
        _holders -= 1
        if _holders == 0:
            os.umask(_operator_umask)
            _operator_umask = None


def job_umask() -> int:
    """The umask a job runs with: the one in force before the runner started."""
    if _operator_umask is not None:
        return _operator_umask
    current = os.umask(PRIVATE_UMASK)
    os.umask(current)
    return current
