"""Stop 21's rules about a job's end through a real `motor serve` and its CLI:

- keeperd writes a job's pid into `keeper.json` only once the job has run 0.1 s: a job
  over sooner keeps the claim as it was (keeperd named, `job_pid` null) and its
  `status.json` says how it ended; a job still running gets its pid;
- the build-folder guard runs after the job's end (0.25 s later, batched per workspace):
  a workspace whose `target/` went over `--build-folder-cap-bytes` loses its incremental
  directories and keeps the rest.
"""

from __future__ import annotations

import json

import psutil
import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e


def _job_dir(serve, job_id: str):
    return serve.state_dir / "jobs" / job_id


def _run(serve, *args: str) -> dict:
    """`motor run --json ARGS`: its terminal record (the last of its JSON lines)."""
    result = serve.cli("run", *args, json_output=True)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout.splitlines()[-1])["record"]


def test_keeper_json_names_the_pid_of_a_job_that_runs_on_not_of_a_short_one(serve, tmp_path):
    short = _run(serve, "--", "true")
    short_dir = _job_dir(serve, short["job_id"])
    claim = json.loads((short_dir / "keeper.json").read_text())
    assert claim["kind"] == "keeperd" and claim["job_pid"] is None, claim
    assert json.loads((short_dir / "status.json").read_text())["exit_code"] == 0

    gate = tmp_path / "gate"
    long = serve.cli_json("submit", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done")
    long_dir = _job_dir(serve, long["job_id"])
    try:
        kept = wait_for(lambda: (k := json.loads((long_dir / "keeper.json").read_text()
                                                 if (long_dir / "keeper.json").exists() else "{}"))
                        .get("job_pid") and k, what="keeper.json to get the running job's pid")
        proc = psutil.Process(kept["job_pid"])
        assert proc.name() == "sh" and kept["job_create_time"] == proc.create_time()
    finally:
        gate.touch()
    wait_for(lambda: (_job_dir(serve, long["job_id"]) / "status.json").exists(),
             what="the running job to end")
    assert json.loads((long_dir / "status.json").read_text())["exit_code"] == 0


def test_a_workspace_over_the_cap_loses_its_incremental_dirs_after_the_job_ends(serve_factory):
    serve = serve_factory("--build-folder-cap-bytes", "65536").start()
    script = ("mkdir -p target/debug/deps target/debug/incremental/app-1/s-1"
              " && head -c 200000 /dev/zero > target/debug/deps/big"
              " && head -c 4000 /dev/zero > target/debug/incremental/app-1/s-1/data")
    job = _run(serve, "--workspace", "built", "--", "sh", "-c", script)
    assert job["state"] == "succeeded", job
    (ws,) = [w for w in serve.cli_json("workspaces") if w["name"] == "built"]
    target = serve.state_dir / "workspaces" / "built" / "target" / "debug"
    assert ws["path"] == str(target.parent.parent)
    wait_for(lambda: not (target / "incremental").exists(), what="the guard to drop incremental/")
    assert (target / "deps" / "big").stat().st_size == 200000
