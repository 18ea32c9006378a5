"""A job in a workspace served through --caller-root runs in the host directory."""

from __future__ import annotations

import os

import pytest

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

