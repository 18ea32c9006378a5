"""`motor serve`'s lines to standard error and standard output, written by threads of their own.

The runner logs to standard error: the journal under systemd, a pipe or a terminal
elsewhere. A write there blocks for as long as nobody reads it (a stalled journald, a pipe
into a paused pager, a terminal held with Ctrl-S). Written from the event loop, as
`logging.basicConfig`'s handler did before stop 67, one such write held the whole runner:
with a 4 KiB pipe nobody read, health stopped answering after 67 jobs and SIGTERM no
longer stopped it.

So the one handler on the root logger only formats a record and appends the line to a
bounded queue (`LineSink.put`, which never blocks); a daemon thread writes what is
queued, in order, with `os.write` (the GIL released while a write waits), gathering the
lines of `LINGER_S` into one write. While standard
error takes nothing the queue holds up to `QUEUE_LINES` lines; later lines are dropped and
counted, and once writes go through again a line says how many were dropped at that point.
Health reports the sink (`report`) and is `degraded` under `log` while a write has waited
`STALLED_S` or more. At the stop the queue gets `DRAIN_S` to be written, no more.

The one line `motor serve` prints on standard output (`motor: listening on ...`) goes the
same way (`say`, a second sink on standard output), for the same reason.

Not `logging.handlers.QueueListener`: its `stop()` joins its thread without a bound, and
the handler it writes through holds its lock during the write, which `logging.shutdown`
(run at exit) takes too, so a stalled standard error would hold the exit for ever."""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from typing import TextIO

#: lines held while standard error takes none; further lines are dropped and counted
QUEUE_LINES = 10_000
#: health says `degraded` once one write has waited this long
STALLED_S = 5.0
#: how long the stop waits for the queued lines to be written
DRAIN_S = 2.0
#: how long the writer waits, once woken by a line, for more to write with it
LINGER_S = 0.02

_current: LineSink | None = None
_stdout: LineSink | None = None
_saved: tuple[list[logging.Handler], int] | None = None


class LineSink:
    """Lines written to `target` by a thread, in order; `put` never blocks. `target`: a file
    descriptor, or a text stream without one (a test's captured `sys.stderr`)."""

    def __init__(self, target: int | TextIO = 2, max_lines: int = QUEUE_LINES,
                 clock=time.monotonic, linger: float = LINGER_S):
        self._target, self._max, self._clock, self._linger = target, max_lines, clock, linger
        self._lines: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._writing_since: float | None = None
        self._unsaid = 0  # dropped since the last line that said so
        self.written = 0
        self.dropped = 0
        self.failed = 0  # lines a write refused (standard error closed: EPIPE, EBADF)
        self._thread = threading.Thread(target=self._run, name="motor-log", daemon=True)
        self._thread.start()

    def put(self, line: str) -> None:
        """Queue one line (ending in a newline); dropped and counted when the queue is full
        or the sink closed."""
        with self._cond:
            if self._closed or len(self._lines) >= self._max:
                self.dropped += 1
                self._unsaid += 1
                return
            self._lines.append(line)
            self._cond.notify()

    def report(self) -> dict:
        """What health shows: lines written, dropped and waiting, and how long the write
        under way has waited (0 when none is)."""
        with self._cond:
            since = self._writing_since
            return {"written_lines": self.written, "dropped_lines": self.dropped,
                    "failed_lines": self.failed, "waiting_lines": len(self._lines),
                    "write_waiting_ms": 0.0 if since is None
                    else round((self._clock() - since) * 1000.0, 3)}

    def stalled_s(self) -> float:
        """How long the write under way has waited (0.0 when none is)."""
        with self._cond:
            since = self._writing_since
        return 0.0 if since is None else self._clock() - since

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s until every queued line is written; whether they were."""
        deadline = self._clock() + timeout
        with self._cond:
            while self._lines or self._writing_since is not None:
                left = deadline - self._clock()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = DRAIN_S) -> bool:
        """Write what is queued, waiting up to `timeout` s, and stop taking lines; whether
        everything was written. A write still waiting is left to the daemon thread."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._lines and not self._unsaid and not self._closed:
                    self._cond.wait()
                closed = self._closed
            if not closed:  # the lines of the next moments go in the same write: in a burst
                time.sleep(self._linger)  # of job ends one wake-up here per batch, not per line
            with self._cond:
                if self._closed and not self._lines:
                    return
                batch = list(self._lines)
                self._lines.clear()
                unsaid, self._unsaid = self._unsaid, 0
                self._writing_since = self._clock()
            if unsaid:  # they came after the batch's lines: the queue was full of them
                batch.append(f"motor: {unsaid} log line{'s' if unsaid != 1 else ''} dropped "
                             f"here (standard error took none while {self._max} were "
                             "waiting)\n")
            ok = self._write_all("".join(batch))
            with self._cond:
                if ok:
                    self.written += len(batch)
                else:
                    self.failed += len(batch)
                self._writing_since = None
                self._cond.notify_all()

    def _write_all(self, text: str) -> bool:
        fd = self._target
        try:
            if not isinstance(fd, int):
                fd.write(text)
                fd.flush()
                return True
            view = memoryview(text.encode("utf-8", "replace"))
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:  # someone made the shared file non-blocking
                    select.select([], [fd], [], 1.0)
        except (OSError, ValueError):  # closed (EPIPE, EBADF, a closed stream): these
            return False  # lines are lost, the next ones may not be
        return True


class SinkHandler(logging.Handler):
    """The root logger's handler: formats a record and queues it (`LineSink.put`)."""

    def __init__(self, sink: LineSink):
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging's own handleError writes to stderr
            line = f"motor: a log record could not be formatted: {record.msg!r} {record.args!r}"
        self.sink.put(line + "\n")


def install(level: str) -> LineSink:
    """`motor serve`'s logging: every record at `level` and above (and warnings) through
    one sink on standard error, one line per record, unstamped (the journal stamps each
    line), in place of the root logger's handlers until `uninstall`."""
    global _current, _saved, _stdout
    sink = LineSink(_target("stderr"))
    _stdout = LineSink(_target("stdout"))
    handler = SinkHandler(sink)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    _saved = (list(root.handlers), root.level)
    for old in _saved[0]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    _current = sink
    return sink


def uninstall(timeout: float = DRAIN_S) -> None:
    """Close the sink (its lines get `timeout` s to be written) and put the root logger's
    handlers back: `motor serve` run in-process (the tests) leaves logging as it found it."""
    global _current, _saved, _stdout
    sink, _current = _current, None
    if sink is None:
        return
    out, _stdout = _stdout, None
    deadline = time.monotonic() + timeout
    sink.close(timeout)  # standard error first: it has the last lines (a stop, an error)
    if out is not None:
        out.close(max(0.0, deadline - time.monotonic()))
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, SinkHandler):
            root.removeHandler(handler)
    handlers, level = _saved or ([], logging.WARNING)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    _saved = None


def _target(name: str) -> int | TextIO:
    """`sys.<name>`'s descriptor, or the stream itself when it has none (captured)."""
    import sys
    stream = getattr(sys, name)
    try:
        stream.flush()  # what was written through it before comes first
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return stream


def current() -> LineSink | None:
    """The sink `install` made in this process, or None (an embedding program's logging
    is its own)."""
    return _current


def say(text: str) -> None:
    """One line to standard output: through its sink when `install` made one, else directly."""
    if _stdout is not None:
        _stdout.put(text + "\n")
    else:
        import sys
        print(text, flush=True, file=sys.stdout)


def line(text: str) -> None:
    """One line to standard error: through the sink when there is one, else directly."""
    if _current is not None:
        _current.put(text + "\n")
    else:
        import sys
        sys.stderr.write(text + "\n")
