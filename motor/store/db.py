"""SQLite storage of job records and events (the durable half of the store subsystem).

Theory of operation
-------------------
One database file, `<state-dir>/motor.db`, in WAL mode with `synchronous=NORMAL`: a crash of
the runner loses nothing committed; a power cut may lose the last commits, never corrupt.
The store actor is the only writer, on `conn`: on the event loop while commits are fast, in a
worker thread while the disk is slow (motor/store/pace.py). Readers (event replay, listings,
start-up) use `reader`, a connection of their own: in WAL mode each read sees what was
committed when it began, never a commit in progress. A read from another thread (a worker
thread's hook, an offloaded call) gets a connection of that thread's: two threads' reads on
one connection would share one read transaction, and a read begun while another thread's
statement was still open saw that statement's older snapshot (a job accepted a moment
before was "not found").

Tables
  jobs(job_id PK, state, terminal, record JSON, log_offset, next_seq, retain_until_ms)
      `record` is the msgspec-encoded JobRecord; `log_offset` is how far the keeper's
      output.log has been turned into events (advanced in the same transaction as the
      events, so a restart never duplicates or drops output); `next_seq` the next event seq.
      `idem_key` the record's idempotency_key, written with the job's first row and
      indexed: `keyed` finds the job a key was accepted with (docs/protocol.md,
      "Idempotent submits"; added in stop 51, created on open when missing).
  events(job_id, seq, data JSON) WITHOUT ROWID, primary key (job_id, seq).
  meta(key PK, value)   schema version.
  clocks(job_id PK, queue_wait_ms, queue_clock_at_ms, queue_clock_running, ready_at_ms,
         budget_enforced_by) WITHOUT ROWID
      A queued job's queue-wait clock saved alone (`ClockSave`, issue 14): the dispatcher
      persists the clocks of every job queued in a workspace each time one starts or ends
      there, and rewriting each whole record cost about as much as the rest of the store.
      A row overrides those fields of `jobs.record` when a record is read back (every read
      below overlays it); any full save of the job deletes it in the same transaction, so
      a record saved after a clock wins. Created on open when missing (older databases).

Output pages: a job's events are grouped in pages of PAGE_EVENTS consecutive seqs. When a
job's stored output passes `max_output_bytes`, its oldest pages lose their `output`
events (whole pages, oldest first, down to three quarters of the cap) and
`jobs.truncated_before_seq` records where the kept output starts, so a replay from before
it begins with a `truncated` event instead of silently skipping (scheduling.md,
"Retention"). Other events (accepted, started, terminal) are never evicted.
`jobs.output_bytes` counts the stored (JSON-encoded) size of the output events, so the cap
bounds the database, not just the text; only complete pages are evicted (never the page
still being filled), so a job's stored output stays below the cap plus one page.

Space: freed pages go to SQLite's freelist and are reused by later inserts, so evicting a
running job's output does not grow the file. New databases are created with
`auto_vacuum=INCREMENTAL`; `expire` then hands free pages beyond RECLAIM_KEEP_PAGES back to
the file system (`PRAGMA incremental_vacuum`, at most RECLAIM_MAX_PAGES per call). A
database created before that keeps `auto_vacuum=NONE` (changing it needs a full VACUUM,
which motor does not run by itself): its space is reused but the file does not shrink.
`journal_size_limit` truncates the WAL file back to WAL_SIZE_LIMIT when the WAL starts over
after it grew larger.

Checkpoints: by default SQLite copies the WAL back into the database file inside the commit
that grows the WAL past 1,000 pages, with two `fdatasync`s (WAL, then database) under
`synchronous=NORMAL`. In the runner that commit runs on the event loop's thread (the store
writes in its caller's task), so every checkpoint stalled everything for as long as the
disk took to sync: 10-20 ms on this host's journaled ext4, about once per 45 jobs, and far
longer on a build host whose disk is busy with builds (docs/performance-history.md, stop 26).
The store actor therefore turns the commits' checkpoints off (`background_checkpoints`) and runs
`checkpoint` in a worker thread on a connection of its own, when motor/store/checkpoints.py
says (by `commits`, `bytes_written` and `wal_bytes`; docs/operations.md, "The job
database's checkpoints").
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import msgspec

from .. import faults
from ..lifecycle import ACTIVE_STATES, RUNNING
from ..records import JobRecord, Output, encode_event, Event, TERMINAL_STATES
from .checkpoints import WAL_SIZE_LIMIT
from .fileguard import FileGuard, uri
from .pace import CommitPace
from .reserve import Reserve
from .salvage import salvage, tell_once, unreadable

SCHEMA_VERSION = 1
PAGE_EVENTS = 64
RECLAIM_KEEP_PAGES = 256  # free pages kept for reuse after an expiry pass (1 MiB of 4 KiB pages)
#: free pages handed back per expiry call (4 MiB; 4,096 took 290 ms on this host, stop 63)
RECLAIM_MAX_PAGES = 1024
#: stored output deleted per expiry call, one transaction (at least one job's, whatever its
#: size): its deletion took about 3.7 ms per MiB on this host, so a day's verbose jobs are
#: deleted in many short transactions, the saves waiting meanwhile written between them
EXPIRE_BATCH_BYTES = 4 * 1024**2
EVENTS_READ_BYTES = 1024 * 1024  # events_from stops after this many bytes (at least one row)
_OUTPUT_PREFIX = b'{"event":"output"'
_COLUMNS = {  # added after the first schema: created on open when missing
    "output_bytes": "INTEGER NOT NULL DEFAULT 0",
    "truncated_before_seq": "INTEGER NOT NULL DEFAULT 0",
    "idem_key": "TEXT",  # the record's idempotency_key, written when the job's row is made
}


class CheckpointResult(NamedTuple):
    """`PRAGMA wal_checkpoint(PASSIVE)`'s answer and how long it took."""

    busy: int  # 1 when a lock kept it from starting (another checkpointer)
    wal_frames: int  # frames in the WAL (-1: not in WAL mode)
    checkpointed: int  # of them, copied into the database file (fewer: a reader's snapshot)
    seconds: float

    @property
    def complete(self) -> bool:
        return self.busy == 0 and self.checkpointed == self.wal_frames


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    terminal INTEGER NOT NULL DEFAULT 0,
    record BLOB NOT NULL,
    log_offset INTEGER NOT NULL DEFAULT 0,
    next_seq INTEGER NOT NULL DEFAULT 1,
    retain_until_ms INTEGER
);
CREATE INDEX IF NOT EXISTS jobs_live ON jobs(terminal, job_id);
CREATE INDEX IF NOT EXISTS jobs_retention ON jobs(retain_until_ms) WHERE terminal = 1;
CREATE TABLE IF NOT EXISTS clocks (
    job_id TEXT PRIMARY KEY,
    queue_wait_ms INTEGER NOT NULL,
    queue_clock_at_ms INTEGER,
    queue_clock_running INTEGER NOT NULL,
    ready_at_ms INTEGER,
    budget_enforced_by TEXT
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
"""

_record_decoder = msgspec.json.Decoder(JobRecord)
_encoder = msgspec.json.Encoder()

#: the clock fields a `ClockSave` writes, in the `clocks` table's column order
CLOCK_FIELDS = ("queue_wait_ms", "queue_clock_at_ms", "queue_clock_running", "ready_at_ms",
                "budget_enforced_by")
#: a record read back with its job's clock row, if any (LEFT JOIN: c.job_id is NULL if none)
#: (and the row's own job id and state, for a record that does not decode: salvage.py)
_WITH_CLOCK = ("SELECT j.record, c.job_id, c.queue_wait_ms, c.queue_clock_at_ms,"
               " c.queue_clock_running, c.ready_at_ms, c.budget_enforced_by, j.job_id, j.state"
               " FROM jobs j LEFT JOIN clocks c ON c.job_id = j.job_id")


class ClockSave(NamedTuple):
    """A queued job's queue-wait clock (and budget enforcer), saved without its record: what
    the dispatcher's clock saves change (`DispatchMachine._clock_saves`)."""

    job_id: str
    queue_wait_ms: int
    queue_clock_at_ms: int | None
    queue_clock_running: bool
    ready_at_ms: int | None
    budget_enforced_by: str | None

    @classmethod
    def of(cls, record: JobRecord) -> "ClockSave":
        return cls(record.job_id, record.queue_wait_ms, record.queue_clock_at_ms,
                   record.queue_clock_running, record.ready_at_ms, record.budget_enforced_by)


def _decode(row) -> JobRecord:
    """A `_WITH_CLOCK` row: the stored record, with its clock row's fields if it has one; a
    record this version cannot decode is read as salvage.py says (never an exception: one
    such row must not stop every read, nor the runner's start)."""
    try:
        record = _record_decoder.decode(row[0])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        record = salvage(row[0], row[7], row[8], exc)
        if unreadable(record):
            return record
    if row[1] is None:
        return record
    wait, at, running, ready, enforcer = row[2:7]
    if not (type(wait) is int and (at is None or type(at) is int) and running in (0, 1)
            and (ready is None or type(ready) is int) and enforcer in (None, "client", "runner")):
        # a damaged clock row (motor writes integers and these words): the clock the record
        # itself holds, from its last whole save, rather than arithmetic on text at recovery
        tell_once(("clock", record.job_id), "job %s: its saved queue-wait clock cannot be read "
                  "(%r): the clock in its record is used", record.job_id, tuple(row[2:7]))
        return record
    return msgspec.structs.replace(
        record, queue_wait_ms=wait, queue_clock_at_ms=at, queue_clock_running=bool(running),
        ready_at_ms=ready, budget_enforced_by=enforcer)


class StoreError(RuntimeError):
    """The database could not be opened or is not motor's."""


class StoreFull(StoreError):
    """A write failed because the state filesystem is full (SQLITE_FULL, ENOSPC).

    The write was rolled back whole; the connection stays usable, and the next write
    succeeds once there is space again.
    """


class StoreUnwritable(StoreFull):
    """A write failed because the state filesystem cannot be written at all now: an I/O
    error, or a file system remounted read-only (SQLITE_IOERR, SQLITE_READONLY; ext4 with
    `errors=remount-ro` after an error). Handled as a full one (the write rolled back
    whole, submits refused with the reason, a job's start and end retried until a write
    succeeds), since both leave the store unable to record and the runner able to wait;
    before stop 60 such a write crashed the store and the dispatcher actors, and a submit
    was answered `internal_error`."""


class StoreLocked(StoreError):
    """A write found the database's write lock held by another connection (another process:
    e.g. an sqlite3 shell left in a write transaction) and did not wait for it (SQLITE_BUSY):
    nothing of it was written. The store actor writes it again in a worker thread, waiting
    for the lock (store/actor.py); the runner's own connections never take that lock."""


#: how long one write attempt in a worker thread waits for another connection's write lock
#: (the store actor then tries again; on the event loop a write never waits for it)
LOCK_WAIT_MS = 1000


def _is_locked(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return isinstance(exc, sqlite3.OperationalError) and "database is locked" in str(exc)


def _of_a_started_job(write: tuple) -> bool:
    """A write of a job that has started: its start, a batch of its output, its end. The
    writes the store's reserve is kept for (store/reserve.py): not an accept, not a queue
    clock, which admission answers for."""
    return len(write) == 4 and (write[0].state == RUNNING or write[0].state in TERMINAL_STATES)


def _is_full(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF == sqlite3.SQLITE_FULL
    return isinstance(exc, sqlite3.Error) and "disk is full" in str(exc)


def _is_unwritable(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY)
    return isinstance(exc, sqlite3.Error) and any(
        text in str(exc) for text in ("disk I/O error", "readonly database"))


class _ReadConnection(sqlite3.Connection):
    """A read connection (a subclass only so that the database can hold it weakly)."""


class Database:
    def __init__(self, path: Path, *, max_output_bytes: int | None = None, check: bool = False):
        """Open (create) the database. `check`: run `PRAGMA quick_check` first (the runner
        does at start-up: a corrupt page stops it with one line instead of surfacing later)."""
        self.path = path
        self.max_output_bytes = max_output_bytes
        #: why the last write failed for lack of space (None: the last write succeeded);
        #: health reports it as `degraded`
        self.full_error: str | None = None
        #: write transactions committed by `save`/`save_many` (bench/throughput.py's
        #: transactions per job; tests count them)
        self.commits = 0
        #: `checkpoint`'s own connection (opened by its first call) and why the last
        #: checkpoint failed (None: it did not); the store actor's checkpointer keeps the
        #: count of its rounds and the last one's figures here (health shows them)
        self._checkpoint_conn: sqlite3.Connection | None = None
        self.checkpoint_error: str | None = None
        self.checkpoints = 0
        self.last_checkpoint: dict | None = None
        #: where the store actor's commits run (the loop, or a worker thread while the
        #: disk is slow), and what it saw of their times; health shows it
        self.pace = CommitPace()
        #: bytes of records and events written by committed transactions (about what
        #: they added to the WAL; the store actor checkpoints by it and by `commits`)
        self.bytes_written = 0
        self._txn_bytes = 0
        #: the state file system's reserve (store/reserve.py), set by `open_database`
        self.reserve: Reserve | None = None
        try:
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # only takes effect while the file is still empty (a new database): set it first,
            # and only then (setting it takes the write lock, which another connection may
            # hold: an existing database opens without it, and its writes wait, store/actor.py)
            if self.conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                self.conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute("PRAGMA busy_timeout=5000")
            self.conn.executescript(_SCHEMA)
            self.page_size = self.conn.execute("PRAGMA page_size").fetchone()[0]
            have = {r[1] for r in self.conn.execute("PRAGMA table_info(jobs)")}
            for column, decl in _COLUMNS.items():
                if column not in have:
                    self.conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {decl}")
            self.conn.execute("CREATE INDEX IF NOT EXISTS jobs_idem_key ON jobs(idem_key)"
                              " WHERE idem_key IS NOT NULL")
            row = self.conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            #: jobs that may have a row in `clocks` (a superset: a job leaves it only once
            #: the transaction that deleted its row committed): a record save deletes the
            #: row only for these, one statement less for the others (issue 14)
            self._clocked = {r[0] for r in self.conn.execute("SELECT job_id FROM clocks")}
            self._unclocked: list[str] = []  # rows deleted by the open transaction
            if check:
                self._quick_check()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open job database {path}: {exc}") from None
        if row is None:
            self.conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise StoreError(f"{path} has schema {row[0]}, newer than this motor ({SCHEMA_VERSION})")
        # from here on a write never waits for another connection's write lock unless told
        # (`save_many`'s lock_wait_ms): on the event loop it must not (StoreLocked)
        self.conn.execute("PRAGMA busy_timeout=0")
        self._lock_wait_ms = 0
        #: whether `path` still names the file opened here (fileguard.py)
        self.guard = FileGuard(path, self.conn)
        #: the connection reads use, never the writer's: the store's commits may run in a
        #: worker thread (store/pace.py), and a read on the writer's connection during one
        #: would see its uncommitted rows. One per reading thread (`reader`): this one is
        #: the opening thread's (the event loop's: listings, replays, start-up).
        self._reader = self._open_reader()
        self._reader_thread = threading.get_ident()
        #: the other threads' (each held by its thread: it closes when the thread ends;
        #: those still open are closed with the database)
        self._thread_readers = threading.local()
        self._other_readers: weakref.WeakSet = weakref.WeakSet()
        self._readers_lock = threading.Lock()

    def _open_reader(self) -> sqlite3.Connection:
        conn = sqlite3.connect(uri(self.path), isolation_level=None, check_same_thread=False,
                               factory=_ReadConnection, uri=True)
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    @property
    def reader(self) -> sqlite3.Connection:
        """The calling thread's read connection. Statements of two threads on one
        connection share its read transaction: a read that began while another thread's
        statement was open would see that statement's snapshot, not the last commit."""
        if threading.get_ident() == self._reader_thread:
            return self._reader
        conn = getattr(self._thread_readers, "conn", None)
        if conn is None:
            conn = self._thread_readers.conn = self._open_reader()
            with self._readers_lock:
                self._other_readers.add(conn)
        return conn

    def _quick_check(self) -> None:
        try:
            rows = self.conn.execute("PRAGMA quick_check(3)").fetchall()
        except sqlite3.DatabaseError as exc:
            rows = [(str(exc),)]
        if rows != [("ok",)]:
            found = "; ".join(str(r[0]).strip() for r in rows)
            raise StoreError(
                f"job database {self.path} is damaged (database disk image is malformed:"
                f" {found}); stop here, keep a copy, then restore it from a backup or rebuild"
                f" it with `sqlite3 motor.db .recover`")

    def close(self) -> None:
        if self._checkpoint_conn is not None:  # first: the last close checkpoints the rest
            self._checkpoint_conn.close()
            self._checkpoint_conn = None
        with self._readers_lock:
            others = list(self._other_readers)
        for conn in (self._reader, *others):
            conn.close()
        self.guard.save_copy()  # when its path lost the file: what it holds, kept
        self.conn.close()

    # -- checkpoints (store actor: in a worker thread) ----------------------------------

    def background_checkpoints(self) -> None:
        """No commit checkpoints the WAL any more (`wal_autocheckpoint=0`): the caller runs
        `checkpoint` itself, off the thread that commits (see the module docstring)."""
        self.conn.execute("PRAGMA wal_autocheckpoint=0")

    def wal_bytes(self) -> int:
        """The size of the WAL file (a high-water mark: a WAL started over reuses it, and
        it is truncated back to WAL_SIZE_LIMIT)."""
        try:
            return os.stat(f"{self.path}-wal").st_size
        except FileNotFoundError:
            return 0

    def checkpoint(self) -> CheckpointResult:
        """One PASSIVE checkpoint (it never waits for a reader or the writer: what it cannot
        copy now waits for the next one) on a connection of its own, so it may run in a
        worker thread while commits go on; one caller at a time. sqlite3.Error (the disk
        full, an I/O error) is recorded in `checkpoint_error` and raised."""
        t0 = time.perf_counter()
        try:
            if self._checkpoint_conn is None:
                conn = sqlite3.connect(uri(self.path), isolation_level=None,
                                       check_same_thread=False, uri=True)
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
                self._checkpoint_conn = conn
            busy, frames, done = self._checkpoint_conn.execute(
                "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            self.checkpoint_error = f"WAL checkpoint of {self.path} failed: {exc}"
            raise
        self.checkpoint_error = None
        return CheckpointResult(busy, frames, done, time.perf_counter() - t0)

    # -- writes (store actor only) ----------------------------------------------------------

    def save(self, record: JobRecord, events: Sequence[Event] = (), *,
             log_offset: int | None = None, retain_until_ms: int | None = None) -> list[Event]:
        """Upsert a record and append events (seqs assigned here) in one transaction."""
        return self.save_many([(record, events, log_offset, retain_until_ms)])[0]

    def save_many(self, writes: Sequence[tuple], lock_wait_ms: int = 0) -> list[list[Event]]:
        """`_save_many`. Where the file system is full and the writes are of a job that has
        started, once more after deleting the store's reserve, if it holds one
        (store/reserve.py), which a later commit makes again."""
        try:
            stamped = self._save_many(writes, lock_wait_ms)
        except StoreFull as exc:
            if self.reserve is None or isinstance(exc, StoreUnwritable) \
                    or not any(map(_of_a_started_job, writes)) or not self.reserve.release():
                raise
            stamped = self._save_many(writes, lock_wait_ms)
        if self.reserve is not None and not self.reserve.held:
            self.reserve.restore_later()
        return stamped

    def _save_many(self, writes: Sequence[tuple], lock_wait_ms: int = 0) -> list[list[Event]]:
        """Several saves, each `(record, events, log_offset, retain_until_ms)` as `save`
        takes them, in order and in ONE transaction (one commit, one WAL sync point): all
        of them are written or, on an error, none. A write with a fifth item that is true,
        `(record, (), None, None, True)`, saves only the record's clock (`ClockSave`); runs
        of consecutive clocks are written with one `executemany`. Returns each save's
        stamped events (none for a clock). Another connection's write lock is waited for up
        to `lock_wait_ms` (0: not at all), then StoreLocked (nothing written)."""
        if not writes:
            return []
        conn = self._lock_wait(lock_wait_ms)
        self.guard.check()  # written all the same: the open file is saved as it closes
        self._unclocked, self._txn_bytes = [], 0
        try:
            conn.execute("BEGIN IMMEDIATE")  # where another connection's write lock stops it
            stamped: list[list[Event]] = []
            clocks: list[ClockSave] = []
            for write in writes:
                if len(write) > 4 and write[4]:
                    clocks.append(ClockSave.of(write[0]))
                    stamped.append([])
                    continue
                if clocks:
                    self._write_clocks(clocks)
                    clocks = []
                stamped.append(self._write(*write[:4]))
            if clocks:
                self._write_clocks(clocks)
            conn.execute("COMMIT")
            self.bytes_written += self._txn_bytes
        except BaseException as exc:
            self._unclocked = []  # rolled back: their rows are still there
            more = len({w[0].job_id for w in writes}) - 1
            what = f"cannot save job {writes[0][0].job_id}" + (f" (and {more} more)" if more else "")
            self._failed_write(exc, what)
            raise
        self._clocked.difference_update(self._unclocked)
        self._unclocked = []
        self.commits += 1
        self.full_error = None
        return stamped

    def _lock_wait(self, ms: int) -> sqlite3.Connection:
        """The write connection, set to wait up to `ms` for another connection's write lock."""
        if ms != self._lock_wait_ms:
            self.conn.execute(f"PRAGMA busy_timeout={int(ms)}")
            self._lock_wait_ms = ms
        return self.conn

    def _write_clocks(self, clocks: list[ClockSave]) -> None:
        self._clocked.update(clock.job_id for clock in clocks)  # before: a superset
        self._txn_bytes += 64 * len(clocks)  # a row of ids and numbers
        self.conn.executemany("INSERT OR REPLACE INTO clocks VALUES (?, ?, ?, ?, ?, ?)", clocks)

    def _write(self, record: JobRecord, events: Sequence[Event], log_offset: int | None,
               retain_until_ms: int | None) -> list[Event]:
        """One save inside the caller's transaction. The record supersedes a clock saved
        alone before it (it holds the newest clock: the dispatcher saves what it holds)."""
        conn = self.conn
        if record.job_id in self._clocked:
            conn.execute("DELETE FROM clocks WHERE job_id=?", (record.job_id,))
            self._unclocked.append(record.job_id)
        data = _encoder.encode(record)
        self._txn_bytes += len(data)
        if not events and log_offset is None:
            # A record alone (a queue-wait clock, a start): its seqs and offset stay as they
            # are, so one UPDATE does (issue 14: most saves are clocks); INSERT when new.
            cur = conn.execute(
                "UPDATE jobs SET state=?, terminal=?, record=?, retain_until_ms=? WHERE job_id=?",
                (record.state, int(record.state in TERMINAL_STATES), data, retain_until_ms,
                 record.job_id))
            if cur.rowcount:
                return []
        row = conn.execute(
            "SELECT next_seq, log_offset FROM jobs WHERE job_id=?", (record.job_id,)
        ).fetchone()
        next_seq, old_offset = row if row else (1, 0)
        stamped = []
        for event in events:
            event.seq = next_seq
            next_seq += 1
            stamped.append(event)
        rows = [(record.job_id, e.seq, encode_event(e)) for e in stamped]
        conn.executemany("INSERT INTO events VALUES (?, ?, ?)", rows)
        terminal = record.state in TERMINAL_STATES
        self._txn_bytes += sum(len(row[2]) for row in rows)
        conn.execute(
            "INSERT INTO jobs (job_id, state, terminal, record, log_offset, next_seq, retain_until_ms,"
            " idem_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET state=excluded.state, terminal=excluded.terminal,"
            " record=excluded.record, log_offset=excluded.log_offset, next_seq=excluded.next_seq,"
            " retain_until_ms=excluded.retain_until_ms",
            (record.job_id, record.state, int(terminal), data,
             old_offset if log_offset is None else log_offset, next_seq, retain_until_ms,
             record.idempotency_key),
        )
        # the cap is on what is stored: the encoded event (JSON escapes included)
        added = sum(len(row[2]) for row, e in zip(rows, stamped) if isinstance(e, Output))
        del rows
        if added:
            conn.execute("UPDATE jobs SET output_bytes = output_bytes + ? WHERE job_id=?",
                         (added, record.job_id))
            if self.max_output_bytes is not None:
                self._evict_pages(record.job_id, next_seq)
        return stamped

    def _failed_write(self, exc: BaseException, what: str) -> None:
        """Roll back what is left of a failed write; raise StoreFull when the disk is full,
        StoreUnwritable when it takes no writes at all, StoreLocked when another connection
        holds the write lock.

        SQLite rolls a transaction back itself on some errors (SQLITE_FULL among them), so
        ROLLBACK runs only while a transaction is still open (on a file system that cannot
        be written, the rollback may fail the same way: the write's error is the one said)."""
        unwritable = _is_unwritable(exc)
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                if not unwritable:
                    raise
        if _is_full(exc):
            self.full_error = f"{what}: the state filesystem is full ({exc})"
            raise StoreFull(self.full_error) from None
        if unwritable:
            self.full_error = (f"{what}: the state filesystem cannot be written ({exc}): an "
                               "I/O error, or a file system mounted read-only")
            raise StoreUnwritable(self.full_error) from None
        if _is_locked(exc):
            raise StoreLocked(f"{what}: another connection holds the database's write lock "
                              f"({exc})") from None

    def _evict_pages(self, job_id: str, next_seq: int) -> None:
        """Drop the oldest complete output pages of a job above the cap (inside save's
        transaction). The page still being filled (seqs up to `next_seq` - 1 assigned) is
        never evicted: its later events would land below truncated_before_seq, stored but
        never replayed nor counted again. Deleting `seq <= hi` (not just the page) also
        removes output such a leak left behind in a database written by an older motor."""
        conn = self.conn
        (total, truncated) = conn.execute(
            "SELECT output_bytes, truncated_before_seq FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        if total <= self.max_output_bytes:
            return
        goal = self.max_output_bytes * 3 // 4
        page = max(truncated - 1, 0) // PAGE_EVENTS
        while total > goal:
            hi = (page + 1) * PAGE_EVENTS  # the last seq of this page
            if hi >= next_seq:  # the page is not complete yet
                break
            where = "job_id=? AND seq<=? AND substr(data, 1, 17)=?"
            args = (job_id, hi, _OUTPUT_PREFIX)
            (freed,) = conn.execute(
                f"SELECT coalesce(sum(length(data)), 0) FROM events WHERE {where}", args).fetchone()
            conn.execute(f"DELETE FROM events WHERE {where}", args)
            total = max(total - freed, 0)
            truncated = hi + 1
            page += 1
        conn.execute("UPDATE jobs SET output_bytes=?, truncated_before_seq=? WHERE job_id=?",
                     (total, truncated, job_id))

    def truncated_before(self, job_id: str) -> int:
        """Output events with a lower seq were evicted (0: nothing was)."""
        row = self.reader.execute(
            "SELECT truncated_before_seq FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return row[0] if row else 0

    def expire(self, now_ms: int, limit: int = 1000, lock_wait_ms: int = 0,
               max_bytes: int = EXPIRE_BATCH_BYTES) -> list[str]:
        """Delete terminal jobs whose retention has passed, up to `limit` of them and
        `max_bytes` of their stored output (at least one job), in one transaction; returns
        their ids (the caller calls again until none is left). Another connection's write
        lock: as `save_many`."""
        ids, total = [], 0
        for job_id, stored in self._lock_wait(lock_wait_ms).execute(
                "SELECT job_id, output_bytes FROM jobs WHERE terminal=1 AND retain_until_ms <= ?"
                " LIMIT ?", (now_ms, limit)):
            if ids and total + stored > max_bytes:
                break
            ids.append(job_id)
            total += stored
        if ids:
            faults.hit("store.expire")  # tests: a deletion held (a day's verbose jobs)
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                for job_id in ids:
                    self.conn.execute("DELETE FROM events WHERE job_id=?", (job_id,))
                    self.conn.execute("DELETE FROM clocks WHERE job_id=?", (job_id,))
                    self.conn.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))
                self.conn.execute("COMMIT")
            except BaseException as exc:
                self._failed_write(exc, "cannot delete expired jobs")
                raise
            self._clocked.difference_update(ids)
        try:
            self.reclaim()
        except StoreLocked:  # the deletions stand; a later round hands the pages back
            pass
        return ids

    def reclaim(self) -> int:
        """Hand free pages beyond RECLAIM_KEEP_PAGES back to the file system (databases with
        incremental auto-vacuum only; at most RECLAIM_MAX_PAGES per call). Returns the pages
        handed back."""
        conn = self.conn
        if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
            return 0
        excess = conn.execute("PRAGMA freelist_count").fetchone()[0] - RECLAIM_KEEP_PAGES
        if excess <= 0:
            return 0
        n = min(excess, RECLAIM_MAX_PAGES)
        # executescript steps the pragma to completion; execute() would free one page only
        try:
            conn.executescript(f"PRAGMA incremental_vacuum({n});")
        except BaseException as exc:
            self._failed_write(exc, "cannot hand free pages back")
            raise
        return n

    # -- reads ----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        row = self.reader.execute(_WITH_CLOCK + " WHERE j.job_id=?", (job_id,)).fetchone()
        return _decode(row) if row else None

    def has(self, job_id: str) -> bool:
        """Whether the job is recorded (`get` without decoding its record)."""
        return self.reader.execute("SELECT 1 FROM jobs WHERE job_id=?", (job_id,)).fetchone() \
            is not None

    def keyed(self, key: str) -> JobRecord | None:
        """The retained job accepted with idempotency key `key`, if any (the oldest, should
        two share it: a database written by hand)."""
        row = self.reader.execute(_WITH_CLOCK + " WHERE j.idem_key=? ORDER BY j.job_id LIMIT 1",
                                  (key,)).fetchone()
        return None if row is None else _decode(row)

    def log_offset(self, job_id: str) -> int:
        row = self.reader.execute("SELECT log_offset FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return row[0] if row else 0

    def live(self) -> list[JobRecord]:
        """Jobs not yet terminal, oldest (by UUIDv7 id) first (but those whose record cannot be
        read: nothing of this runner's to queue or adopt, salvage.py)."""
        return [r for r in map(_decode, self.reader.execute(
            _WITH_CLOCK + " WHERE j.terminal=0 ORDER BY j.job_id")) if not unreadable(r)]

    def ended_between(self, after: tuple[int, str], until_ms: int,
                      limit: int = 1000) -> list[tuple[int, str]]:
        """(retain_until_ms, job_id) of terminal jobs after `after` in that order, up to
        `until_ms` of retain_until_ms: the jobs whose end was saved in a span (their
        retention is their end's time plus RETENTION_MS), for the maintenance pass that
        empties their job directories."""
        return self.reader.execute(
            "SELECT retain_until_ms, job_id FROM jobs WHERE terminal=1"
            " AND (retain_until_ms, job_id) > (?, ?) AND retain_until_ms <= ?"
            " ORDER BY retain_until_ms, job_id LIMIT ?", (*after, until_ms, limit)).fetchall()

    def active(self) -> list[JobRecord]:
        """Jobs setting up or running, oldest first: what start-up needs for adoption and its
        sweep, without decoding every queued record (10,000 of them at scale, issue 14)."""
        return [r for r in self._active_rows() if not unreadable(r)]

    def active_unreadable(self) -> list[str]:
        """Ids of the jobs recorded setting up or running whose record cannot be read
        (salvage.py): none of this runner's to adopt, so start-up stops their processes."""
        return [r.job_id for r in self._active_rows() if unreadable(r)]

    def _active_rows(self) -> list[JobRecord]:
        return [_decode(r) for r in self.reader.execute(
            _WITH_CLOCK + " WHERE j.terminal=0 AND j.state IN (?, ?) ORDER BY j.job_id",
            tuple(sorted(ACTIVE_STATES)))]

    def listing(self, *, limit: int = 200, terminal: bool | None = None) -> list[JobRecord]:
        """Newest first."""
        if terminal is None:
            rows = self.reader.execute(
                _WITH_CLOCK + " ORDER BY j.job_id DESC LIMIT ?", (limit,))
        else:
            rows = self.reader.execute(
                _WITH_CLOCK + " WHERE j.terminal=? ORDER BY j.job_id DESC LIMIT ?",
                (int(terminal), limit))
        return [_decode(r) for r in rows]

    def iter_terminal(self) -> Iterable[JobRecord]:
        for row in self.reader.execute(_WITH_CLOCK + " WHERE j.terminal=1"):
            yield _decode(row)

    def events_from(self, job_id: str, from_seq: int, limit: int = 500,
                    max_bytes: int = EVENTS_READ_BYTES) -> list[bytes]:
        """Stored events from `from_seq` in order: at most `limit` of them, and no more once
        `max_bytes` are reached (at least one), so a replay of big output stays bounded."""
        out: list[bytes] = []
        size = 0
        cursor = self.reader.execute(
            "SELECT data FROM events WHERE job_id=? AND seq>=? ORDER BY seq LIMIT ?",
            (job_id, from_seq, limit))
        try:
            for (data,) in cursor:
                out.append(data)
                size += len(data)
                if size >= max_bytes:
                    break
        finally:
            cursor.close()
        return out

    def count(self) -> int:
        return self.reader.execute("SELECT count(*) FROM jobs").fetchone()[0]


def open_database(state_dir: Path, *, max_output_bytes: int | None = None, check: bool = True,
                  reserve: Reserve | None = None) -> Database:
    """The job database of `state_dir`. With a `reserve` (store/reserve.py): a database that
    cannot be opened on a full file system deletes it and is opened once more, and a
    started job's writes delete it when they find the file system full."""
    path = state_dir / "motor.db"
    try:
        db = Database(path, max_output_bytes=max_output_bytes, check=check)
    except StoreError:
        if reserve is None or not reserve.release_if_full():
            raise
        db = Database(path, max_output_bytes=max_output_bytes, check=check)
    db.reserve = reserve
    return db
