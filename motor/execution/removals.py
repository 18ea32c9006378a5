"""keeperd's removal of ended jobs' v1 groups, in a thread of its own (issue 14).

keeperd reads a v1 cgroup job's counters when the job has ended and nothing is left in its
groups (`isolation_facts` in status.json). Those groups are then of no more use: keeperd
says so in the status (`isolation_released`) and hands them to this thread, which removes
them after the status is written. The runner then removes nothing at the job's end (no
worker-thread hop and no `rmdir` in its process: 0.4-0.5 ms of its CPU per job in a
burst, docs/performance-history.md "Stop 53").

Why a thread: on v1 an `rmdir` waits for the kernel's cgroup mutex, which a migration (a
spare thread joining its groups, spares.py) holds for a whole RCU grace period after an idle
spell (10-20 ms here); keeperd's loop, which answers every start, must not wait for that.

A group still busy (a task on its way out) is retried until `DEADLINE_S`; one that cannot
be removed by then is logged and tried again every `RETRY_EVERY_S` while keeperd runs, for
`RETRY_FOR_S` (a runner that stays up for weeks does not collect such groups until its
next start); one still there after that is logged again and left to the runner's next
start-up sweep (the job is terminal). Removals still queued when keeperd stops get
`CLOSE_S` to finish; what a stopped or killed keeperd leaves is the sweep's too.

Stdlib only (keeperd is run by path: motor/execution/scriptboot.py).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable

from motor.isolation.join import rmdir_retry

__all__ = ["CLOSE_S", "DEADLINE_S", "RETRY_EVERY_S", "RETRY_FOR_S", "GroupRemover"]

#: how long a busy group is retried
DEADLINE_S = 3.0
#: a group still busy after that is tried once every so many seconds ...
RETRY_EVERY_S = 60.0
#: ... for so long, then left to the runner's next start-up sweep
RETRY_FOR_S = 3600.0
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
        later: dict[str, float] = {}  # a group given up on for now -> until when it is tried
        due = math.inf  # when those are tried next
        while True:
            try:
                dirs = self.queue.get(timeout=max(0.0, due - time.monotonic()) if later else None)
            except queue.Empty:
                dirs = {}
            if dirs is None:
                return
            for path in dirs.values():
                if error := rmdir_retry(path, time.monotonic() + DEADLINE_S):
                    self.log(f"{error}: tried again every {RETRY_EVERY_S:g} s for "
                             f"{RETRY_FOR_S:g} s, then the runner's next start-up sweep removes it")
                    if not later:
                        due = time.monotonic() + RETRY_EVERY_S
                    later[path] = time.monotonic() + RETRY_FOR_S
            if later and time.monotonic() >= due:
                self._try_again(later)
                due = time.monotonic() + RETRY_EVERY_S

    def _try_again(self, later: dict[str, float]) -> None:
        """One `rmdir` for each group given up on for now: gone, or given up on for good."""
        for path, until in list(later.items()):
            if rmdir_retry(path, 0.0) is None:
                del later[path]
                self.log(f"removed {path} on a later try")
            elif time.monotonic() >= until:
                del later[path]
                self.log(f"cannot remove {path} after {RETRY_FOR_S:g} s of tries: the "
                         "runner's next start-up sweep removes it")
