"""When the job database's WAL is checkpointed, and when the store's writes wait for it.

Pure (no trio, no I/O): the store actor tells `CheckpointPlan` of each commit and carries
its answers out in `_checkpointer` (motor/store/actor.py). Why checkpoints run in a worker
thread at all: motor/store/db.py, "Checkpoints"; for operators: docs/operations.md, "The job
database's checkpoints".

A *round* is one PASSIVE checkpoint while commits go on, then, when the WAL it found had
grown past WAL_RESTART_BYTES without starting over, a second one with the writes held: the
frames written during the first are copied, the round completes, and the next commit starts
the WAL over. Commits written during a round's first step keep the WAL from starting over,
so without the second step a busy runner's WAL would only grow. Should the rounds still fall
behind (large commits faster than the disk syncs), a commit that finds the WAL file larger
than WAL_HOLD_BYTES holds the writes until a round has run in two steps.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHECKPOINT_BYTES", "CHECKPOINT_EVERY", "CheckpointPlan", "WAL_HOLD_BYTES",
           "WAL_RESTART_BYTES", "WAL_SIZE_LIMIT", "WAL_STUCK_BYTES", "wal_stuck"]

#: the size a WAL file that grew larger is truncated back to when it starts over
#: (`journal_size_limit`, set by db.py)
WAL_SIZE_LIMIT = 8 * 1024 * 1024

#: a round after this many commits (one writes about 6.5 pages: about SQLite's own
#: 1,000-page interval) or this many bytes of records and events written (output batches:
#: their pages, and those an eviction rewrites, come to about twice their bytes)
CHECKPOINT_EVERY = 128
CHECKPOINT_BYTES = 1024 * 1024
#: a round that finds this much in the WAL holds the writes for its second step: SQLite's
#: own 1,000 pages, so the WAL stays near the size it had when each commit checkpointed
WAL_RESTART_BYTES = 4 * 1024 * 1024
#: the WAL file larger than this (the size it is truncated back to): writes wait for a round
WAL_HOLD_BYTES = WAL_SIZE_LIMIT
#: the WAL file larger than this, and the last round could not copy all of it: a read
#: transaction held open on the database (another process's) keeps it from starting over
WAL_STUCK_BYTES = 4 * WAL_SIZE_LIMIT


def wal_stuck(wal_file_bytes: int, last_round: dict | None) -> bool:
    """Whether the WAL grows because something keeps it from starting over: the file is
    past WAL_STUCK_BYTES (the rounds and holds keep it near WAL_SIZE_LIMIT otherwise) and
    the last round (`last_round`: the store's `last_checkpoint`) left a part of it uncopied,
    which only a reader's snapshot does. Stop 60's probe: a second process inside `BEGIN`
    after one `SELECT` let the WAL reach 137 MiB over 2,000 jobs while health said `ok`."""
    return wal_file_bytes > WAL_STUCK_BYTES and last_round is not None \
        and not last_round["complete"]


@dataclass
class CheckpointPlan:
    """The store's checkpoint bookkeeping: where the last round began, and whether the WAL
    file was past WAL_HOLD_BYTES at the last commit."""

    commits_at: int = 0
    written_at: int = 0
    wal_over: bool = False

    def committed(self, commits: int, written: int, wal_file_bytes: int) -> bool:
        """After a commit (the database's `commits`, `bytes_written`, the WAL file's size):
        whether a round is due. `wal_over` then says whether the writes must wait for it."""
        self.wal_over = wal_file_bytes > WAL_HOLD_BYTES
        return (self.wal_over or commits - self.commits_at >= CHECKPOINT_EVERY
                or written - self.written_at >= CHECKPOINT_BYTES)

    def begin(self, commits: int, written: int) -> None:
        """A round begins: the next one counts from here."""
        self.commits_at, self.written_at = commits, written

    def second_step(self, wal_frames: int, page_size: int) -> bool:
        """After a round's first step, which found `wal_frames` in the WAL: whether to hold
        the writes for a second step (so the WAL starts over)."""
        return self.wal_over or wal_frames * page_size >= WAL_RESTART_BYTES
