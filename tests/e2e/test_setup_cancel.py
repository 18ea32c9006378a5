"""A job cancelled during its setup never starts (a real `motor serve`, a setup barrier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from job_markers import child_named
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


def test_job_cancelled_while_its_keeper_is_spawned_ends_cancelled_when_the_spawn_fails(
        serve_factory, tmp_path, monkeypatch):
    """The cancel arrives while the forkserver is forking the job's keeper, and the spawn
    then fails with nothing claimed (the forkserver dies): the job ends `cancelled`, it is
    not requeued to run later."""
    gate = tmp_path / "fork-gate"
    monkeypatch.setenv("MOTOR_FAULTS", f"forkserver.forked=wait:{gate}")
    monkeypatch.setenv("MOTOR_SPAWNER", "forkserver")  # the per-job keeper's forkserver dies
    serve = serve_factory("--max-weight", "1").start()
    marker = tmp_path / "ran"
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c", f"touch {marker}")["job_id"]
    wait_for(Path(f"{gate}.reached").exists, what="the keeper's fork to reach the barrier")
    forkserver = child_named(serve.proc.pid, "forkserver")
    assert serve.cli("cancel", job_id).returncode == 0  # remembered: no keeper yet
    forkserver.kill()  # the spawn fails before any claim: nothing of the job can run
    forkserver.wait(10)
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0", timeout=30)
    record = json_lines(result.stdout)[-1]["record"]
    assert (record["state"], record["reason"], record["detail"]) == (
        "cancelled", "cancelled", "cancelled during setup"), record
    assert record.get("started_at_ms") is None and not marker.exists()
    gate.write_text("")  # later forks pass the barrier: the runner keeps serving
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0
