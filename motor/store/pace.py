"""Whether the store's commits run on the event loop or in a worker thread.

Pure (no trio, no I/O): the store actor tells `CommitPace` how long each commit took (on the
runner's clock: real time in production; under a test's clock a blocking commit takes none)
and asks it where the next one runs (motor/store/actor.py). For operators: docs/operations.md,
"When the disk is slow".

A commit on a healthy disk takes a fraction of a millisecond (WAL, `synchronous=NORMAL`: no
sync at a commit), less than the hop to a worker thread and back (0.15-0.3 ms on a 2-core
host), and two commits are on every job's way to its start: so commits run on the event
loop. But a commit's writes can wait on the kernel: when a build writes gigabytes to the
same file system, dirty-page throttling makes `write()` sleep, tens to hundreds of
milliseconds per commit; on the loop that stops the whole runner (the API, health, event
streams, every actor) for as long. So the first commit that takes SLOW_COMMIT_S or more
moves the commits to a worker thread (the loop runs on while they wait on the disk; saves
wait in the store's inbox and are committed together when it returns), and they come back
to the loop once no commit has been slow for CALM_S.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CALM_S", "CommitPace", "SLOW_COMMIT_S", "STALLED_COMMIT_S"]

#: a commit this slow (or slower) moves the commits off the event loop
SLOW_COMMIT_S = 0.005
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

    def place(self, now: float) -> bool:
        """Before a commit at `now` (the runner's clock): whether it runs off the loop."""
        if self.off_loop and now - self.last_slow_at >= CALM_S:
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
        if not self.off_loop:
            self.off_loop = True
            self.moves_off_loop += 1

    def waiting_s(self, now: float) -> float:
        """How long the commit in progress has waited by `now` (the runner's clock), 0 if
        none."""
        since = self.waiting_since
        return 0.0 if since is None else max(0.0, now - since)
