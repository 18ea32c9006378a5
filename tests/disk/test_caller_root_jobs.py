"""A job in a workspace served through --caller-root runs in the host directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import motor_env
from tests.polling import wait_for

pytestmark = pytest.mark.e2e


def test_a_caller_path_workspace_runs_in_its_host_directory(serve_factory, tmp_path):
    host = tmp_path / "host-home"
    host.mkdir()
    serve = serve_factory("--caller-root", f"/home/alice={host}").start()
    result = serve.cli("run", "--workspace", "/home/alice/src/app", "--", "sh", "-c",
                       "pwd; echo made > built.txt")
    assert result.returncode == 0, result.stderr
    tree = os.path.realpath(host / "src" / "app")
    assert result.stdout.decode().splitlines()[0] == tree
    assert (host / "src" / "app" / "built.txt").read_text() == "made\n"
    rows = serve.cli_json("workspaces")
    row = next(r for r in rows if r.get("caller_path") == "/home/alice/src/app")
    assert row["path"] == tree  # the catalog keeps the caller's path, the tree is on the host
    assert not os.path.exists("/home/alice/src/app/built.txt")  # never the caller's /home

    # a path no caller root serves is a bad request, not a directory outside the roots
    other = serve.cli("run", "--workspace", "/etc/motor-evil", "--", "true")
    assert other.returncode == 65
    assert "caller-root" in other.stderr.decode()
    bad = serve.cli("run", "--workspace", "/home/alice/../bob", "--", "true")
    assert bad.returncode == 65



def test_a_caller_path_with_control_characters_is_shown_escaped(serve_factory, tmp_path):
    """A caller path may hold any character but NUL: `motor status`, `jobs` and `workspaces`
    show its control characters escaped (motor/cli/text.py), never raw on the terminal."""
    host = tmp_path / "host-home"
    host.mkdir()
    serve = serve_factory("--caller-root", f"/home/alice={host}").start()
    hostile = "/home/alice/x\x1b]0;pwned\x07"
    job_id = serve.cli("submit", "--workspace", hostile, "--", "sleep", "30").stdout.decode().strip()
    assert job_id, "the submit was refused"
    try:
        wait_for(lambda: serve.cli_json("status")["running"], what="the job to run (its workspace made)")
        for command in ("status", "jobs", "workspaces"):
            out = subprocess.run(  # wide: a table cell's text on one line
                [sys.executable, "-m", "motor", command, "--socket", str(serve.socket)],
                capture_output=True, timeout=60, env=motor_env({"COLUMNS": "1000"})).stdout
            assert b"\x1b" not in out and b"\x07" not in out, (command, out)
            assert b"x\\x1b]0;" in out, (command, out)  # (a long cell is cut short with "…")
    finally:
        serve.cli("cancel", job_id)
