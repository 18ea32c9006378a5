"""State on disk is private (issue 10 part 5): a job's `env` must not be readable by other
users from `motor.db`, `spec.json` or `output.log`.

motor sets umask 077 before it creates anything: a state tree it creates is 0700, every
file it (or a keeper) writes is 0600. A state dir the operator made is left as it is. The
job itself runs with the umask `motor serve` was started with.
"""

from __future__ import annotations

import os
import stat

import pytest

from polling import json_lines

pytestmark = pytest.mark.e2e

SECRET = "s3cr3t-token"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _run_job(serve) -> str:
    result = serve.cli("run", "--json", "--env", f"TOKEN={SECRET}", "--",
                       "sh", "-c", "echo out; touch made-by-job")
    assert result.returncode == 0, result.stderr.decode()
    return json_lines(result.stdout)[-1]["record"]["job_id"]


def _assert_private_files(state, job_id) -> None:
    job_dir = state / "jobs" / job_id
    for path in (state / "motor.db", state / "motor.db-wal", state / "runner.lock",
                 job_dir / "spec.json", job_dir / "output.log", job_dir / "status.json",
                 job_dir / "keeper.json"):
        assert path.exists(), path
        assert _mode(path) == 0o600, (path, oct(_mode(path)))
    for path in (state / "jobs", job_dir):
        assert _mode(path) == 0o700, (path, oct(_mode(path)))
    assert SECRET in (job_dir / "spec.json").read_text()  # what must stay private


def test_a_fresh_state_tree_is_0700_and_its_files_0600(serve_factory, tmp_path):
    state = tmp_path / "deep" / "state"  # not there yet: motor creates it
    serve = serve_factory(state_dir=tmp_path / "fixture")  # Serve.start makes this one
    serve.args[serve.args.index("--state-dir") + 1] = str(state)
    serve.socket = state / "motor.sock"
    serve.start()
    job_id = _run_job(serve)
    assert _mode(state) == 0o700
    _assert_private_files(state, job_id)
    workspace = state / "workspaces"
    assert _mode(workspace) == 0o700
    made = next(workspace.glob("*/made-by-job"))
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(made) == 0o666 & ~umask  # the job keeps the operator's umask


def test_an_existing_state_dir_keeps_its_mode_but_motor_files_are_0600(serve_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    serve = serve_factory(state_dir=state).start()
    job_id = _run_job(serve)
    assert _mode(state) == 0o755
    _assert_private_files(state, job_id)

