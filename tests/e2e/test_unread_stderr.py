"""A `motor serve` whose standard error nobody reads (a stalled journald, a pipe into a
paused pager, a terminal held with Ctrl-S) goes on serving, says so in health, loses no
log line it kept, and stops on SIGTERM (motor/logsink.py). Before stop 67 the runner wrote
its log lines from the event loop: with a 4 KiB pipe nobody read, the 67th job's end line
held the whole runner (health unanswered, SIGTERM ignored)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from motor.client import Client

from tests.conftest import ROOT, motor_env
from polling import wait_for

pytestmark = pytest.mark.e2e

JOBS = 200  # each job's end is a line of about 50 bytes: 10 KB, more than the pipe's 4 KiB


def start_unread(state_dir) -> tuple[subprocess.Popen, int]:
    """`motor serve` with standard error a 4 KiB pipe this test does not read (yet): the
    process and the pipe's read end."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    out = open(state_dir.parent / "serve.out", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "motor", "serve", "--state-dir", str(state_dir),
         "--isolation", "none", "--free-space-floor-bytes", "0"],
        stdout=out, stderr=w, env=motor_env(), cwd=ROOT)
    os.close(w)
    out.close()
    wait_for(lambda: (state_dir / "motor.sock").exists() or proc.poll() is not None,
             what="the runner's socket")
    assert proc.poll() is None
    return proc, r


def run_jobs(client: Client, n: int, proc: subprocess.Popen, r: int) -> list[str]:
    """N `true` jobs, one after another, each followed to its end; their ids. A job that
    fails to run fails the test with the runner's state and what it wrote."""
    ids = []
    for i in range(n):
        try:
            stream = client.submit({"command": ["true"], "workspace": f"w{i % 4}"},
                                   follow=True, raw=True)
            stream.response.set_read_timeout(30)  # a held runner: a failure, not a hang
            with stream:
                events = list(stream)
        except Exception as exc:
            raise AssertionError(f"job {i + 1} of {n}: {exc}; the runner "
                                 + ("runs" if proc.poll() is None else f"exited {proc.poll()}")
                                 + f"; its standard error held:\n{held(r)}") from exc
        ids.append(events[0]["job_id"])
        assert events[-1]["record"]["state"] == "succeeded", events[-1]
    return ids


def held(r: int) -> str:
    """What the pipe holds now, read without waiting (a failure's diagnosis)."""
    os.set_blocking(r, False)
    try:
        return os.read(r, 65536).decode(errors="replace")
    except BlockingIOError:
        return ""
    finally:
        os.set_blocking(r, True)


def log_causes(health: dict) -> list[dict]:
    return [d for d in health["degraded"] if d["subsystem"] == "log"]


def test_serve_whose_standard_error_nobody_reads_keeps_serving_and_says_so(tmp_path):
    state = tmp_path / "state"
    proc, r = start_unread(state)
    try:
        with Client(state / "motor.sock", timeout=30) as client:
            ids = run_jobs(client, JOBS, proc, r)  # before: the 67th job's end held the runner
            health = wait_for(lambda: log_causes(h := client.call("GET", "/v1/health")) and h,
                              timeout=30, what="health to say degraded under log")
            assert health["status"] == "degraded"
            [cause] = log_causes(health)
            assert "standard error has taken no log line for" in cause["cause"]
            assert health["log"]["waiting_lines"] > 0 and health["log"]["dropped_lines"] == 0
            received: list[bytes] = []
            reader = threading.Thread(target=lambda: received.extend(iter(
                lambda: os.read(r, 65536), b"")), daemon=True)
            reader.start()  # someone reads again: what was held comes out, in order
            wait_for(lambda: not log_causes(h := client.call("GET", "/v1/health"))
                     and h["log"]["waiting_lines"] == 0, what="no log cause, nothing held")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    os.close(r)
    text = b"".join(received).decode()
    ended = re.findall(r"^job-(\S+): succeeded \(exit 0\)$", text, re.M)
    assert ended == ids  # every job's end line, in order: none lost while it was held
    assert "dropped" not in text


def test_serve_whose_standard_error_nobody_reads_stops_on_sigterm(tmp_path):
    state = tmp_path / "state"
    proc, r = start_unread(state)
    try:
        with Client(state / "motor.sock", timeout=30) as client:
            run_jobs(client, JOBS, proc, r)
        proc.send_signal(signal.SIGTERM)  # before: the loop, held in a write, never saw it
        assert proc.wait(30) == 0  # the held lines get 2 s (logsink.DRAIN_S), no more
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(r)


def serve_that_fails(state_dir, stderr) -> subprocess.Popen:
    """`motor serve` that fails where no supervisor restarts it, once serving
    (`runner.serving=raise`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "motor", "serve", "--state-dir", str(state_dir),
         "--isolation", "none", "--free-space-floor-bytes", "0"],
        stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT,
        env=motor_env({"MOTOR_FAULTS": "runner.serving=raise"}))


def test_serve_that_fails_outside_its_supervisors_exits_even_when_nobody_reads(tmp_path):
    """`motor serve` exits 1 within the sink's drain, its standard error a full pipe nobody
    reads. Before stop 68 the traceback was Python's own, written after the sink was gone:
    the process waited in that write for good, serving nothing and never restarted."""
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.write(w, b"x" * 4096)  # full before the runner writes anything
    proc = serve_that_fails(tmp_path / "state", w)
    os.close(w)
    try:
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(r)


def test_serve_that_fails_outside_its_supervisors_logs_the_traceback_and_exits_1(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = serve_that_fails(tmp_path / "state", out)
    assert proc.wait(60) == 1
    text = log.read_text()
    assert "motor: error: the runner failed where nothing restarts it" in text, text
    assert "Traceback (most recent call last)" in text, text
    assert "FaultInjected: MOTOR_FAULTS: fault injected at runner.serving" in text, text
