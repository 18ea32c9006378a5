"""A subsystem whose supervisor gives up takes `motor serve` down (non-zero exit), and until
then `/v1/health` reports `degraded` with the cause (issue 10 part 2).

The crash loop is injected with the runner's fault hook `MOTOR_FAULTS=actor.<name>=crash`:
that subsystem's actor starts normally, then raises on every message it handles.
"""

from __future__ import annotations

import json
import os
import socket as socketlib
import subprocess
import sys
from pathlib import Path

import pytest

from polling import wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _get(path, target: str) -> tuple[int | None, str]:
    """One HTTP/1.0 GET on the Unix socket (closed on every path, also when the runner dies)."""
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(f"GET {target} HTTP/1.0\r\nHost: motor\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return None, ""
    return int(head.split()[1]), body.decode()


def _cli(socket, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", args[0], "--socket", str(socket), *args[1:]],
                          capture_output=True, timeout=60, cwd=ROOT, env=_env())


def _env(**extra) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MOTOR_")}, **extra}


def test_a_crash_looping_subsystem_shows_degraded_then_the_runner_exits_non_zero(
        tmp_path, serve_factory):
    state = tmp_path / "state"
    socket = state / "motor.sock"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "motor", "serve", "--state-dir", str(state),
             "--free-space-floor-bytes", "0", "--isolation", "none"],
            stdout=out, stderr=subprocess.PIPE, cwd=ROOT,
            env=_env(MOTOR_FAULTS="actor.accounting=crash"))
    try:
        wait_for(lambda: b"listening on" in log.read_bytes() or proc.poll() is not None,
                 what="serve to start")
        assert proc.poll() is None, log.read_text()
        barrier = tmp_path / "go"  # a job running across the give-up and the restart
        submitted = _cli(socket, "submit", "--json", "--", "sh", "-c",
                         f"echo before; while [ ! -e {barrier} ]; do sleep 0.02; done; echo after")
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]
        reports = []

        def probe():
            """One health probe (each one makes the accounting actor crash once)."""
            if proc.poll() is not None:
                return True
            try:  # a fresh connection each time: the runner may be gone
                status, body = _get(socket, "/v1/health")
            except OSError:
                return proc.poll() is not None
            if status is None:  # the runner closed the connection: it is stopping
                return proc.poll() is not None
            assert status == 200, body  # health answers while degraded
            reports.append(json.loads(body))
            return False

        wait_for(probe, timeout=60, interval=0.05, what="the runner to give up and exit")
        status = proc.wait(30)
        stderr = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert status == 3, (status, stderr)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("motor: error: subsystem accounting gave up"), stderr
    assert "FaultInjected" in last and "Traceback" not in last
    degraded = [r for r in reports if r.get("status") == "degraded"]
    assert degraded, reports
    causes = [d for r in degraded for d in r["degraded"] if d["subsystem"] == "accounting"]
    assert causes and all("FaultInjected" in d["cause"] for d in causes), causes
    assert any(d.get("restarts", 0) >= 1 for d in causes), causes
    assert reports[0]["status"] in ("ok", "degraded")

    # what the service manager does next: a fresh runner re-adopts the job, which kept running
    serve = serve_factory(state_dir=state).start()
    barrier.touch()
    attached = serve.cli("attach", job_id, "--from-seq", "0")
    assert attached.returncode == 0 and attached.stdout == b"before\nafter\n", attached
