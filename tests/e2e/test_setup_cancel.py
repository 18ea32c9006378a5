"""A job cancelled during its setup never starts (a real `motor serve`, a setup barrier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def test_job_cancelled_during_setup_never_starts(serve_factory, tmp_path, monkeypatch):
    gate = tmp_path / "setup-gate"
    monkeypatch.setenv("MOTOR_FAULTS", f"setup.begin=wait:{gate}")
    serve = serve_factory("--max-weight", "1").start()
    marker = tmp_path / "ran"
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c", f"touch {marker}")["job_id"]
    wait_for(Path(f"{gate}.reached").exists, what="the job's setup to reach the barrier")
    assert serve.cli_json("status")["running"][0]["state"] == "setup"

    assert serve.cli("cancel", job_id).returncode == 0
    gate.write_text("")  # setup goes on, sees the cancel, and ends the job before spawning
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
    events = json_lines(result.stdout)
    kinds = [e["event"] for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == [
        "accepted", "queued", "terminal"], kinds
    record = events[-1]["record"]
    assert record["state"] == "cancelled" and record["reason"] == "cancelled"
    assert record.get("started_at_ms") is None
    assert not marker.exists()  # the command never ran

    # the runner keeps serving: the permit is free again and the next job runs
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
