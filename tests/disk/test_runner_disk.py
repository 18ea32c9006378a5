"""Disk admission and retention through a real `motor serve` on a 100 MiB tmpfs state dir.

Each test fills the filesystem with real jobs writing real bytes; free space is the kernel's
answer (`statvfs`), not a fake probe. Workspaces written by jobs a moment ago are "recent"
(used in the last 30 minutes), so only hard pressure (below the floor) may evict them.
"""

from __future__ import annotations

import os
import re
import subprocess

import httpx
import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024


def _mount_tmpfs(path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def state100(tmp_path):
    state = tmp_path / "state"
    _mount_tmpfs(state, "100m")
    try:
        yield state
    finally:
        _umount(state)


def _write_job(serve, workspace: str, mib: int):
    """A job that writes `mib` MiB into its workspace; returns the CLI result."""
    result = serve.cli("run", "--workspace", workspace, "--",
                       "sh", "-c", f"head -c {mib * MiB} /dev/zero > blob")
    assert result.returncode == 0, result.stderr.decode()
    return result


def _catalog(serve) -> dict[str, dict]:
    return {row["name"]: row for row in serve.cli_json("workspaces")}


def _free(path) -> int:
    return os.statvfs(path).f_bavail * os.statvfs(path).f_frsize


def test_runner_hard_pressure_keeps_evicting_recent_workspaces_lru_until_the_soft_goal(
        state100, serve_factory):
    serve = serve_factory("--free-space-floor-bytes", str(30 * MiB),
                          "--free-space-eviction-bytes", str(70 * MiB),
                          state_dir=state100).start()
    for i in range(4):  # 80 MiB of recent workspaces, w0 least recently used
        _write_job(serve, f"w{i}", 20)
    assert _free(state100) < 30 * MiB  # below the floor: hard pressure
    wait_for(lambda: all(r["allocated_bytes"] for r in _catalog(serve).values()),
             what="every workspace measured")
    result = serve.cli("run", "--workspace", "new", "--", "true")
    assert result.returncode == 0, result.stderr.decode()
    ws = state100 / "workspaces"
    # LRU order, and not stopping at the floor (w0 alone would have crossed it): until 70 MiB
    assert [w for w in ("w0", "w1", "w2", "w3") if (ws / w).exists()] == ["w3"]
    assert _free(state100) >= 70 * MiB
    assert set(_catalog(serve)) == {"w3", "new"}


def test_runner_a_finished_jobs_workspace_is_not_reserved(state100, serve_factory):
    serve = serve_factory("--free-space-floor-bytes", str(30 * MiB), state_dir=state100).start()
    _write_job(serve, "a", 40)
    _write_job(serve, "b", 40)
    assert _free(state100) < 30 * MiB
    rows = _catalog(serve)
    assert rows["a"]["protected"] is None and rows["b"]["protected"] is None, rows
    # both jobs have ended: their workspaces are idle candidates under hard pressure
    result = serve.cli("run", "--workspace", "c", "--", "true")
    assert result.returncode == 0, result.stderr.decode()
    assert not (state100 / "workspaces" / "a").exists()
    assert "c" in _catalog(serve)


def test_runner_workspace_root_adds_to_the_default_root(state100, serve_factory, tmp_path):
    serve = serve_factory("--free-space-floor-bytes", str(30 * MiB), state_dir=state100).start()
    _write_job(serve, "old", 40)
    serve.stop()
    extra = state100 / "extra-root"  # on the same small filesystem
    serve = serve_factory("--free-space-floor-bytes", str(30 * MiB),
                          "--workspace-root", str(extra), state_dir=state100).start()
    row = _catalog(serve)["old"]
    assert row["protected"] != "outside the allowed roots", row
    with open(state100 / "ballast", "wb") as f:  # not a workspace: never evicted
        f.write(b"\0" * (40 * MiB))
    assert _free(state100) < 30 * MiB
    # the workspace catalogued under the default root is still evicted under pressure
    result = serve.cli("run", "--workspace", "fresh", "--", "pwd")
    assert result.returncode == 0, result.stderr.decode()
    assert not (state100 / "workspaces" / "old").exists()
    # and new workspaces go into the added root
    assert result.stdout.decode().strip() == str(extra / "fresh")


def test_runner_failed_eviction_keeps_the_catalog_entry_and_is_retried(state100, serve_factory):
    serve = serve_factory("--free-space-floor-bytes", str(30 * MiB), state_dir=state100).start()
    _write_job(serve, "stuck", 40)
    _write_job(serve, "other", 10)
    stuck = state100 / "workspaces" / "stuck"
    wait_for(lambda: _catalog(serve)["stuck"]["allocated_bytes"], what="stuck measured")
    # a mount over the workspace: the tree is on another filesystem than its root, so
    # deleting it is refused (never crossing mounts)
    _mount_tmpfs(stuck, "1m")
    try:
        with open(state100 / "ballast", "wb") as f:  # (the store's reserve holds 7.5 MiB)
            f.write(b"\0" * (35 * MiB))
        assert _free(state100) < 30 * MiB
        result = serve.cli("run", "--workspace", "next", "--", "true")
        assert result.returncode == 75, result.stderr.decode()  # runner_disk_full
        assert "runner_disk_full" in result.stderr.decode()
        assert not (state100 / "workspaces" / "other").exists()  # the other one was evicted
        assert "stuck" in _catalog(serve)  # kept for a retry
    finally:
        _umount(stuck)
    # the mount is gone: the next cleanup retries and evicts it
    result = serve.cli("run", "--workspace", "next", "--", "true")
    assert result.returncode == 0, result.stderr.decode()
    assert not stuck.exists()
    assert "stuck" not in _catalog(serve)


def test_runner_workspaces_shows_when_sizes_were_measured(tmp_path, serve_factory):
    serve = serve_factory().start()
    result = serve.cli("run", "--workspace", "w", "--", "sh", "-c", "echo hi > f")
    assert result.returncode == 0, result.stderr.decode()
    wait_for(lambda: _catalog(serve)["w"]["measured_ms"], what="w measured")
    out = serve.cli("workspaces").stdout.decode()
    assert not re.search(r"\d+d\d\dh", out), out  # a wall time shown as a duration
    assert "measured" in out and " ago" in out
    assert 0 <= _catalog(serve)["w"]["measured_age_ms"] < 3600 * 1000


def test_runner_upload_time_disk_full_refusals_count_in_health(tmp_path, serve_factory):
    state = tmp_path / "state"
    _mount_tmpfs(state, "64m")
    try:
        serve = serve_factory("--free-space-floor-bytes", str(128 * MiB), state_dir=state).start()
        sha = "ab" * 32
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)),
                          base_url="http://motor") as http:
            for _ in range(2):
                resp = http.put(f"/v1/bundles/{sha}", content=b"x" * 1024)
                assert resp.status_code == 503 and resp.json()["code"] == "runner_disk_full"
            health = http.get("/v1/health").json()
        assert health["admission_refusals"].get("runner_disk_full") == 2, health
        serve.stop()
    finally:
        _umount(state)
