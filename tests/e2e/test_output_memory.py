"""Runner memory and database size stay bounded whatever a job prints (issue 10, part 3).

Real `motor serve` processes and real jobs; the runner's RSS is sampled with psutil from
this test (a regression guard with a loose bound, not a timing assert).
"""

from __future__ import annotations

import sqlite3
import threading
import time

import psutil
import pytest

from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
TERMINAL = {"succeeded", "failed", "lost", "cancelled", "timed_out"}


class PeakRss(threading.Thread):
    """Samples the RSS of whatever process `serve.proc` is once it differs from `after`."""

    def __init__(self, serve, after=None):
        super().__init__(daemon=True)
        self.serve, self.after = serve, after
        self.peak = 0
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            proc = self.serve.proc
            if proc is not None and proc is not self.after:
                try:
                    self.peak = max(self.peak, psutil.Process(proc.pid).memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.01)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def _state(serve, job_id) -> str | None:
    for record in serve.cli_json("jobs", "--all"):
        if record["job_id"] == job_id:
            return record["state"]
    return None


def _saved_offset(serve, job_id) -> int:
    conn = sqlite3.connect(f"file:{serve.state_dir / 'motor.db'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT log_offset FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0]
    finally:
        conn.close()


def _db_bytes(serve) -> int:
    db = serve.state_dir / "motor.db"
    wal = serve.state_dir / "motor.db-wal"
    return db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def test_restarted_runner_catches_up_on_a_large_output_log_in_bounded_memory(serve_factory, tmp_path):
    """200 MiB printed while the runner was down: the restarted runner stores it in bounded
    batches (RSS stays within +150 MiB of a fresh runner), reaches the end of the log and
    ends the job, instead of reading it all at once (1.3 GiB RSS, OOM-killed, re-read from
    the same offset on every restart)."""
    barrier = tmp_path / "go"
    size = 200 * MiB
    serve = serve_factory("--max-output-bytes-per-job", "8MiB").start()
    baseline = psutil.Process(serve.proc.pid).memory_info().rss
    job = serve.cli_json(
        "submit", "--weight", "1", "--", "sh", "-c",
        f"while [ ! -e {barrier} ]; do sleep 0.01; done; "
        f"yes 'a line of build output 0123456789' | head -c {size}; echo; echo last-line")
    job_id = job["job_id"]
    job_dir = serve.state_dir / "jobs" / job_id
    wait_for((job_dir / "keeper.json").exists, what="the job to start")
    wait_for(lambda: _state(serve, job_id) == "running", what="the job to be running")
    serve.kill9()

    barrier.write_text("")  # the job prints 200 MiB while no runner runs
    wait_for((job_dir / "status.json").exists, timeout=120, what="the keeper to record the exit")
    log_size = (job_dir / "output.log").stat().st_size
    assert log_size > size

    old = serve.proc
    sampler = PeakRss(serve, after=old)
    sampler.start()
    try:
        serve.start()
        wait_for(lambda: _state(serve, job_id) in TERMINAL, timeout=300, interval=0.2,
                 what="the restarted runner to end the job")
    finally:
        peak = sampler.stop()
    assert _state(serve, job_id) == "succeeded"
    assert _saved_offset(serve, job_id) == log_size  # it got to the end of the log
    assert peak - baseline < 150 * MiB, (baseline, peak)

    events = json_lines(serve.cli("attach", "--json", job_id, "--from-seq", "0").stdout)
    assert events[0]["event"] == "truncated"
    text = "".join(e["data"] for e in events if e["event"] == "output")
    assert text.endswith("\nlast-line\n") and "a line of build output 0123456789\n" in text[-200:]


def test_database_stays_bounded_by_the_output_cap(serve_factory):
    """A job printing 96 MiB of coloured output (ANSI escapes, stored JSON-escaped) through
    a 4 MiB cap: motor.db and its WAL stay within the cap plus a fixed slack."""
    cap = 4 * MiB
    serve = serve_factory("--max-output-bytes-per-job", str(cap)).start()
    script = ("import sys\n"
              "line = b'\\x1b[1;31merror\\x1b[0m: \\x1b[32mcolour\\x1b[0m build line 0123456789\\n'\n"
              "block = line * (65536 // len(line))\n"
              f"for _ in range({96 * MiB} // len(block)):\n"
              "    sys.stdout.buffer.write(block)\n"
              "sys.stdout.buffer.write(b'the end\\n')\n")
    job_id = serve.cli_json("submit", "--weight", "1", "--", "python3", "-c", script)["job_id"]
    wait_for(lambda: _state(serve, job_id) in TERMINAL, timeout=300, interval=0.2,
             what="the job to end")
    assert _state(serve, job_id) == "succeeded"
    assert _db_bytes(serve) <= cap + 16 * MiB, _db_bytes(serve)

    replay = json_lines(serve.cli("attach", "--json", job_id, "--from-seq", "0").stdout)
    assert replay[0]["event"] == "truncated"  # the oldest output was evicted, and it says so
    text = "".join(e["data"] for e in replay if e["event"] == "output")
    assert text.endswith("build line 0123456789\nthe end\n")


def test_a_corrupt_output_log_does_not_crash_loop_the_runner(serve_factory, tmp_path):
    """A log the runner cannot parse (here a bad record header) stops the output at that
    point, with the reason in the job's detail; the job still ends with its exit status and
    the runner keeps serving, instead of re-reading the same offset on every restart."""
    from motor.execution.joblog import RECORD_HEADER

    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job_id = serve.cli_json(
        "submit", "--weight", "1", "--", "sh", "-c",
        f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; echo after; exit 3")["job_id"]
    log = serve.state_dir / "jobs" / job_id / "output.log"
    wait_for(lambda: log.exists() and b"before" in log.read_bytes(), what="the first line")
    wait_for(lambda: _stored_output(serve, job_id), what="the first line to be stored")
    with open(log, "ab") as f:
        f.write(RECORD_HEADER.pack(9, 3) + b"bad")
    barrier.write_text("")
    wait_for(lambda: _state(serve, job_id) in TERMINAL, timeout=60, interval=0.2,
             what="the job to end")
    record = [r for r in serve.cli_json("jobs", "--all") if r["job_id"] == job_id][0]
    assert record["state"] == "failed" and record["exit_code"] == 3
    assert "output.log" in record["detail"] and "bad record stream byte 9" in record["detail"]
    events = json_lines(serve.cli("attach", "--json", job_id, "--from-seq", "0").stdout)
    assert "".join(e["data"] for e in events if e["event"] == "output") == "before\n"
    assert serve.proc.poll() is None
    assert serve.cli_json("health")  # still serving
    # and a later job runs normally
    after = serve.cli("run", "--weight", "1", "--", "echo", "fine", timeout=60)
    assert after.returncode == 0 and after.stdout == b"fine\n"


def _stored_output(serve, job_id) -> bool:
    conn = sqlite3.connect(f"file:{serve.state_dir / 'motor.db'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM events WHERE job_id=? AND substr(data, 1, 17)=?",
                            (job_id, b'{"event":"output"')).fetchone()[0] > 0
    finally:
        conn.close()
