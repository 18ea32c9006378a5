"""`motor serve` refuses a state dir it cannot trust with one line and exit status 2
(issue 10 part 6), never a traceback, never a silent empty start.

- motor.db missing or empty while jobs/ holds job directories: those jobs may still run
  under their keepers; starting empty would leave them unsupervised.
- a corrupt page, a read-only state dir, `jobs` being a file.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from polling import json_lines

ROOT = Path(__file__).resolve().parents[2]


def motor_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MOTOR_SOCKET", "MOTOR_STATE_DIR")}

pytestmark = pytest.mark.e2e


def _serve_once(state, timeout: float = 30) -> tuple[int, str]:
    """Start `motor serve` on `state`; it must exit by itself (a refusal)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "motor", "serve", "--state-dir", str(state),
             "--free-space-floor-bytes", "0", "--isolation", "none"],
            capture_output=True, timeout=timeout, env=motor_env(), cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("motor serve started instead of refusing the state dir")
    return proc.returncode, proc.stderr.decode()


def _assert_one_line(status: int, stderr: str, *needles: str) -> str:
    assert status == 2, (status, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    assert line.startswith("motor: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture
def used_state(serve_factory):
    """A state dir a runner used: one job ended (its directory under jobs/), stopped cleanly."""
    serve = serve_factory().start()
    result = serve.cli("run", "--json", "--", "sh", "-c", "echo hi")
    assert result.returncode == 0, result.stderr.decode()
    job_id = json_lines(result.stdout)[-1]["record"]["job_id"]
    assert serve.stop() == 0
    state = serve.state_dir
    assert (state / "jobs" / job_id).is_dir() and not (state / "motor.db-wal").exists()
    return state


def test_missing_database_with_job_directories_is_refused(used_state):
    (used_state / "motor.db").unlink()
    status, stderr = _serve_once(used_state)
    line = _assert_one_line(status, stderr, "motor.db", "1 job director", "jobs")
    assert not (used_state / "motor.db").exists()  # nothing created on the way out
    assert "restore" in line


def test_empty_database_with_job_directories_is_refused(used_state):
    (used_state / "motor.db").write_bytes(b"")
    status, stderr = _serve_once(used_state)
    _assert_one_line(status, stderr, "motor.db", "empty", "jobs")


def test_a_fresh_state_dir_and_an_empty_jobs_dir_still_start(tmp_path, serve_factory):
    state = tmp_path / "state"
    (state / "jobs").mkdir(parents=True)
    serve = serve_factory(state_dir=state).start()
    assert serve.cli_json("jobs", "--all") == []


def test_a_corrupt_page_is_one_line(used_state):
    db = used_state / "motor.db"
    with sqlite3.connect(db) as conn:  # the events table's pages: start-up reads no event
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = [n for (n,) in conn.execute("SELECT pageno FROM dbstat WHERE name='events'")]
    conn.close()
    assert pages
    with open(db, "r+b") as f:
        for n in pages:
            f.seek((n - 1) * page)
            f.write(bytes((i * 7 + 13) % 251 for i in range(page)))
    status, stderr = _serve_once(used_state)
    _assert_one_line(status, stderr, "motor.db", "malformed")


def test_jobs_being_a_file_is_one_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "jobs").write_text("not a directory")
    status, stderr = _serve_once(state)
    _assert_one_line(status, stderr, "jobs", "not a directory")


def test_a_read_only_state_dir_is_one_line(used_state):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only view of the state dir")
    ro = used_state.parent / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(used_state), str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount")
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)],
                              capture_output=True).returncode == 0
        status, stderr = _serve_once(ro)
        _assert_one_line(status, stderr, "read-only")
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
