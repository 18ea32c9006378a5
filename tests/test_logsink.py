"""motor/logsink.py: the lines of `motor serve` reach standard error in order, and a
standard error that nobody reads never holds whoever logs (real pipes, 4 KiB)."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import threading
import time

import pytest

from motor import logsink
from motor.logsink import LineSink, SinkHandler


@pytest.fixture
def pipe():
    """A pipe of one page (4 KiB): (read end, write end), both closed after the test."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    ends = [r, w]
    yield ends
    for fd in ends:
        try:
            os.close(fd)
        except OSError:
            pass


def read_all(fd: int) -> str:
    """What is in the pipe now (the write end still open: read until it would block)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.set_blocking(fd, True)
    return b"".join(chunks).decode()


def in_thread(fn, timeout: float = 10.0) -> None:
    """Run `fn` in a thread; fail if it has not returned within `timeout` s (it blocked)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} blocked"


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_lines_reach_the_descriptor_in_order(pipe):
    r, w = pipe
    sink = LineSink(w)
    for i in range(100):
        sink.put(f"line {i}\n")
    assert sink.flush(10)
    assert read_all(r).splitlines() == [f"line {i}" for i in range(100)]
    assert sink.report() == {"written_lines": 100, "dropped_lines": 0, "failed_lines": 0,
                             "waiting_lines": 0, "write_waiting_ms": 0.0}
    assert sink.close(1)


def test_a_put_never_waits_on_a_pipe_nobody_reads_and_the_overflow_is_counted_then_said(pipe):
    r, w = pipe
    sink = LineSink(w, max_lines=50)
    total = 400

    def put(lines):
        def put_them():
            for i in lines:
                sink.put(f"{i:05d} " + "x" * 93 + "\n")  # 100 bytes
        return put_them

    in_thread(put(range(45)))  # 4,500 bytes: more than the pipe takes
    until(lambda: sink.stalled_s() > 0)  # the writer waits on the pipe, and goes on waiting
    in_thread(put(range(45, total)))  # none of these waits: 50 are queued, the rest dropped
    report = sink.report()
    assert report["waiting_lines"] == 50 and report["dropped_lines"] > 0
    assert report["write_waiting_ms"] > 0
    done = threading.Event()
    received: list[str] = []

    def drain():
        with os.fdopen(os.dup(r), "rb") as f:
            for raw in f:
                received.append(raw.decode().rstrip("\n"))
                if raw.startswith(b"motor: "):
                    done.set()

    threading.Thread(target=drain, daemon=True).start()
    assert sink.flush(10)
    done.wait(10)
    notes = [x for x in received if x.startswith("motor: ")]
    lines = [int(x.split()[0]) for x in received if not x.startswith("motor: ")]
    dropped = sink.report()["dropped_lines"]
    assert notes == [f"motor: {dropped} log lines dropped here (standard error took none "
                     "while 50 were waiting)"]
    assert received[-1] == notes[0]  # after the lines that were queued before the drops
    assert lines == list(range(len(lines)))  # a prefix, in order: nothing reordered
    assert len(lines) + dropped == total
    assert sink.report()["written_lines"] == len(lines) + 1  # and the note
    assert sink.stalled_s() == 0.0


def test_close_returns_within_its_bound_while_a_write_waits(pipe):
    r, w = pipe
    sink = LineSink(w)
    for _ in range(100):
        sink.put("y" * 200 + "\n")  # 20 KB: more than the pipe holds
    until(lambda: sink.stalled_s() > 0)
    result = []
    in_thread(lambda: result.append(sink.close(0.2)))
    assert result == [False]
    sink.put("after the close\n")
    assert sink.report()["dropped_lines"] == 1  # a closed sink takes nothing


def test_a_closed_standard_error_costs_lines_not_whoever_logs(pipe):
    r, w = pipe
    os.close(r)  # nobody will ever read: writes fail with EPIPE (Python ignores SIGPIPE)
    sink = LineSink(w)
    in_thread(lambda: [sink.put(f"{i}\n") for i in range(10)])
    assert sink.flush(10)
    report = sink.report()
    assert report["failed_lines"] == 10 and report["written_lines"] == 0


def test_a_stream_without_a_descriptor_gets_the_lines():
    out = io.StringIO()
    sink = LineSink(out)
    sink.put("one\n")
    sink.put("two\n")
    assert sink.flush(10)
    assert out.getvalue() == "one\ntwo\n"


def test_the_handler_queues_a_record_it_cannot_format_as_a_line_saying_so(pipe):
    r, w = pipe
    handler = SinkHandler(LineSink(w))
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("motor.test.logsink")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("fine %s", "here")
        log.warning("broken %d", "not a number")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    assert handler.sink.flush(10)
    assert read_all(r).splitlines() == [
        "fine here", "motor: a log record could not be formatted: 'broken %d' ('not a number',)"]


def test_install_routes_the_root_logger_and_warnings_through_one_sink_and_uninstall_restores(capsys):
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    logsink.install("info")
    try:
        assert logsink.current() is not None
        logging.getLogger("motor.test").info("an info line")
        logging.getLogger("motor.test").debug("not at info")
        import warnings
        with warnings.catch_warnings():  # (the suite makes warnings errors)
            warnings.simplefilter("always")
            warnings.warn("a warning, as a line")
        logsink.say("motor: a line on standard output")
    finally:
        logsink.uninstall(10)
    assert logsink.current() is None
    assert (list(root.handlers), root.level) == before
    captured = capsys.readouterr()
    assert captured.out == "motor: a line on standard output\n"
    assert captured.err.splitlines()[0] == "an info line"
    assert "a warning, as a line" in captured.err and "not at info" not in captured.err
