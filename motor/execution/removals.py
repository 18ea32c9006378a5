"""keeperd's removal of ended jobs' v1 groups, in a thread of its own (issue 14).

keeperd reads a v1 cgroup job's counters when the job has ended and nothing is left in its
groups (`isolation_facts` in status.json). Those groups are then of no more use: keeperd
says so in the status (`isolation_released`) and hands them to this thread, which removes
them after the status is written. The runner then removes nothing at the job's end (no
worker-thread hop and no `rmdir` in its process: 0.4-0.5 ms of its CPU per job in a
burst, docs/performance.md "Stop 53").

Why a thread: on v1 an `rmdir` waits for the kernel's cgroup mutex, which a migration (a
spare thread joining its groups, spares.py) holds for a whole RCU grace period after an idle
spell (10-20 ms here); keeperd's loop, which answers every start, must not wait for that.

A group still busy (a task on its way out) is retried until `DEADLINE_S`; one that cannot
be removed is logged, and the runner's next start-up sweep removes it (the job is
terminal). Removals still queued when keeperd stops get `CLOSE_S` to finish; what a killed
keeperd leaves is the sweep's too.

Stdlib only (keeperd is run by path: motor/execution/scriptboot.py).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from motor.isolation.join import rmdir_retry

__all__ = ["CLOSE_S", "DEADLINE_S", "GroupRemover"]

#: how long a busy group is retried
DEADLINE_S = 3.0
#: how long keeperd's exit waits for the removals still queued
CLOSE_S = 2.0


class GroupRemover:
    """`remove(dirs)`: the groups (controller -> directory) go, in order, in the thread."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.queue: queue.SimpleQueue[dict[str, str] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def remove(self, dirs: dict[str, str]) -> None:
        if self.thread is None:  # made for the first removal: most keeperds have none
            self.thread = threading.Thread(target=self._run, name="group-remover", daemon=True)
            self.thread.start()
        self.queue.put(dirs)

    def close(self) -> None:
        """At keeperd's exit: the queued removals get `CLOSE_S`."""
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(CLOSE_S)

    def _run(self) -> None:
        while (dirs := self.queue.get()) is not None:
            for path in dirs.values():
                error = rmdir_retry(path, time.monotonic() + DEADLINE_S)
                if error:
                    self.log(f"{error}: the runner's next start-up sweep removes it")
