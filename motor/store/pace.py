"""Whether the store's commits run on the event loop or in a worker thread.

Pure (no trio, no I/O): the store actor tells `CommitPace` how long each commit took (on the
event loop: timed on the runner's clock, real time in production, none for a blocking call
under a test's clock; in a thread: timed there) and asks it where the next one runs
(motor/store/actor.py). For operators: docs/operations.md, "When the disk is slow".

A commit on a healthy disk takes a fraction of a millisecond (WAL, `synchronous=NORMAL`: no
sync at a commit), less than the hop to a worker thread and back (0.15-0.3 ms on a 2-core
host, each time the loop is busy), and three of them are on every job's way (two before
its start): on the loop they cost nothing else, in a thread a burst of short jobs runs
about a fifth slower (bench/loop_stalls.py, stop 27). But a commit's writes can wait on
the kernel: when a build writes gigabytes to the same file system, dirty-page throttling
makes `write()` sleep, and on a disk that stalls a commit waits for seconds; on the loop
that stops the whole runner (the API, health, event streams, every actor) for as long.

So commits stay on the loop through the occasional slow one (a few commits of tens of
milliseconds, as a busy disk gives), and move to a worker thread once slow ones (5 ms or
more, SLOW_COMMIT_S) have held the loop for STALL_BUDGET_S (0.1 s) within WINDOW_S (1 s),
one such commit enough: the loop runs on while they wait on the disk, saves arriving
meanwhile wait in the store's inbox and are committed together after. They come back to
the loop once no commit has been slow for CALM_S (10 s).
A write that found the database's write lock held by another connection (`locked`) moves
them off the loop at once; they stay off while the lock is held and come back CALM_S after
the last write that found it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["CALM_S", "CommitPace", "SLOW_COMMIT_S", "STALL_BUDGET_S", "STALLED_COMMIT_S",
           "WINDOW_S"]

#: a commit this slow (or slower) counts as slow
SLOW_COMMIT_S = 0.005
#: slow commits holding the loop this long within WINDOW_S move the commits off it
STALL_BUDGET_S = 0.1
WINDOW_S = 1.0
#: the commits come back to the loop after this long without a slow one
CALM_S = 10.0
#: a commit waiting this long makes health degraded (the runner answers, but accepting
#: and starting jobs wait for it)
STALLED_COMMIT_S = 1.0


@dataclass
class CommitPace:
    """The store's commit timings: where commits run now, and what it saw."""

    #: commits run in a worker thread
    off_loop: bool = False
    #: the runner's time of the last slow commit (-inf: none yet)
    last_slow_at: float = float("-inf")
    #: commits that took SLOW_COMMIT_S or more, wherever they ran
    slow_commits: int = 0
    #: commits run in a worker thread
    commits_off_loop: int = 0
    #: times the commits moved off the loop
    moves_off_loop: int = 0
    #: the longest commit seen, in seconds
    longest_s: float = 0.0
    #: when the commit in progress began (the runner's clock), None between commits
    waiting_since: float | None = None
    #: since when (the runner's clock) another connection has held the database's write
    #: lock, as the last write found it (None: it did not)
    locked_since: float | None = None
    #: writes that found that lock held, since start
    locked_writes: int = 0
    #: (end, seconds) of the slow commits on the loop within the last WINDOW_S
    _recent: deque = field(default_factory=deque)

    def place(self, now: float) -> bool:
        """Before a commit at `now` (the runner's clock): whether it runs off the loop."""
        if self.off_loop and self.locked_since is None and now - self.last_slow_at >= CALM_S:
            self.off_loop = False
        return self.off_loop

    def took(self, seconds: float, now: float, off_loop: bool) -> None:
        """A commit (placed as `place` said: `off_loop`) took `seconds`; `now` is the
        runner's time when it returned."""
        if off_loop:
            self.commits_off_loop += 1
        if seconds > self.longest_s:
            self.longest_s = seconds
        if seconds < SLOW_COMMIT_S:
            return
        self.slow_commits += 1
        self.last_slow_at = now
        if self.off_loop:
            return
        recent = self._recent
        recent.append((now, seconds))
        while recent[0][0] <= now - WINDOW_S:
            recent.popleft()
        if sum(s for _, s in recent) >= STALL_BUDGET_S:
            self.off_loop = True
            self.moves_off_loop += 1
            recent.clear()

    def locked(self, now: float) -> None:
        """A write at `now` found the database's write lock held by another connection
        (nothing written): the writes move off the loop, where they wait for it, and come
        back CALM_S after it is free."""
        self.locked_writes += 1
        if self.locked_since is None:
            self.locked_since = now
        self.last_slow_at = now
        if not self.off_loop:
            self.off_loop = True
            self.moves_off_loop += 1

    def unlocked(self) -> float | None:
        """A write got the lock; when (the runner's clock) a write first found it held, or
        None when none did."""
        since, self.locked_since = self.locked_since, None
        return since

    def waiting_s(self, now: float) -> float:
        """How long the commit in progress has waited by `now` (the runner's clock), 0 if
        none."""
        since = self.waiting_since
        return 0.0 if since is None else max(0.0, now - since)
