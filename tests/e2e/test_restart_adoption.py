"""Jobs outlive the runner: kill -9 of `serve` while a job runs, then a restart."""

from __future__ import annotations

import pytest

from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def test_kill_9_then_restart_readopts_the_running_job(serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job = serve.cli_json(
        "submit", "--weight", "1", "--",
        "sh", "-c", f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; echo after; exit 7")
    job_id = job["job_id"]
    wait_for(lambda: _has_output(serve, job_id, "before"), what="first line")
    serve.kill9()

    # The runner is gone: the job keeps running under its keeper and prints more.
    barrier.write_text("")
    status_file = serve.state_dir / "jobs" / job_id / "status.json"
    wait_for(status_file.exists, what="the keeper to record the exit status")

    serve.start()
    result = serve.cli("attach", "--json", job_id, "--from-seq", "0")
    events = json_lines(result.stdout)
    output = "".join(e["data"] for e in events if e["event"] == "output")
    assert output == "before\nafter\n"
    assert events[-1]["record"]["exit_code"] == 7
    assert result.returncode == 7


def test_restarted_runner_counts_a_still_running_jobs_cpus(serve_factory, tmp_path):
    barrier = tmp_path / "go"
    serve = serve_factory().start()
    job = serve.cli_json(
        "submit", "--weight", "1", "--",
        "sh", "-c", f"echo before; while [ ! -e {barrier} ]; do sleep 0.01; done; echo after; exit 5")
    job_id = job["job_id"]
    wait_for(lambda: _has_output(serve, job_id, "before"), what="first line")
    cpus = serve.cli_json("status")["running"][0]["cpus"]
    serve.kill9()
    serve.start()

    health = serve.cli_json("health")
    assert health["cpus"]["jobs"] == {job_id: cpus}
    assert health["capacity"]["held_permits"] == 1
    status = serve.cli_json("status")
    assert [r["job_id"] for r in status["running"]] == [job_id]
    assert "reservation_use" not in status["running"][0]  # absent until measured, never null

    barrier.write_text("")
    result = serve.cli("attach", job_id, "--from-seq", "0")
    assert result.returncode == 5
    assert result.stdout == b"before\nafter\n"
    wait_for(lambda: serve.cli_json("health")["capacity"]["held_permits"] == 0,
             what="permits to be released")


def _has_output(serve, job_id: str, text: str) -> bool:
    record_dir = serve.state_dir / "jobs" / job_id / "output.log"
    return record_dir.exists() and text.encode() in record_dir.read_bytes()
