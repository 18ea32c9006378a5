"""End to end: a real `motor serve` on a small tmpfs state dir, driven by the CLI and HTTP."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import time

import httpx
import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024


@pytest.fixture
def tmpfs_state(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(state)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    yield state
    subprocess.run(["umount", "-l", str(state)], capture_output=True)


def _cli_args(serve, command, *rest):
    import sys

    return [sys.executable, "-m", "motor", command, "--socket", str(serve.socket), *rest]


def _http(serve) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)), base_url="http://motor")


def _terminal(out: bytes) -> dict:
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    return lines[-1]


def test_disk_full_wire_refusal_carries_tag_and_bytes_before_upload(tmpfs_state, serve_factory):
    serve = serve_factory("--free-space-floor-bytes", str(128 * MiB), state_dir=tmpfs_state).start()
    body = b"x" * (4 * MiB)
    sha = hashlib.sha256(body).hexdigest()
    with _http(serve) as http:
        resp = http.put(f"/v1/bundles/{sha}", content=body)
    assert resp.status_code == 503
    data = resp.json()
    assert data["refused"] is True and data["code"] == "runner_disk_full"
    assert data["floor_bytes"] == 128 * MiB and 0 < data["free_bytes"] < 64 * MiB
    bundles = tmpfs_state / "bundles"
    assert not bundles.exists() or os.listdir(bundles) in ([], ["pins.json"])
    # the CLI: --bundle is refused before the job is submitted, exit 75
    tar = tmpfs_state.parent / "src.tar"
    tar.write_bytes(b"not really a tar")
    result = serve.cli("run", "--bundle", str(tar), "--", "true")
    assert result.returncode == 75
    assert result.stderr.decode().startswith("motor: refused: runner_disk_full: ")
    assert serve.cli_json("jobs", "--all") == []


def test_disk_full_reaches_run_and_prepare_callers_with_known_reason_and_detail(
        tmpfs_state, serve_factory):
    # at admission: the floor is bigger than the whole filesystem
    serve = serve_factory("--free-space-floor-bytes", str(128 * MiB), state_dir=tmpfs_state).start()
    result = serve.cli("run", "--json", "--", "true")
    assert result.returncode == 75
    assert result.stderr.decode().startswith("motor: refused: runner_disk_full: free space ")
    record = _terminal(result.stdout)["record"]
    assert record["state"] == "refused_before_start" and record["reason"] == "runner_disk_full"
    assert record["floor_bytes"] == 128 * MiB and record["free_bytes"] > 0
    serve.stop()
    # at setup: admitted, then the disk fills (outside any workspace) before the job's setup
    serve = serve_factory("--free-space-floor-bytes", str(24 * MiB), "--max-weight", "1",
                          state_dir=tmpfs_state).start()
    gate = tmpfs_state / "go"
    holder = subprocess.Popen(
        [*_cli_args(serve, "run", "--weight", "1", "--workspace", "w", "--"),
         "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = serve.cli_json("status")
            if status["running"]:
                break
            time.sleep(0.05)
        queued = subprocess.Popen(
            [*_cli_args(serve, "run", "--json", "--weight", "1", "--workspace", "w", "--"), "true"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not serve.cli_json("status")["queued"]:
            time.sleep(0.05)
        with open(tmpfs_state / "ballast", "wb") as f:  # not a workspace: never evicted
            f.write(b"\0" * (48 * MiB))
        gate.write_text("")
        out, err = queued.communicate(timeout=60)
        assert queued.returncode == 75, err
        assert err.decode().startswith("motor: refused: runner_disk_full: free space ")
        record = _terminal(out)["record"]
        assert record["state"] == "refused_before_start"
        assert record["reason"] == "runner_disk_full"
        assert "below the floor of 25165824 bytes" in record["detail"]
    finally:
        gate.write_text("")
        holder.communicate(timeout=60)


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_run_with_a_bundle_unpacks_it_as_the_workspace_source(tmp_path, serve):
    bundle = tmp_path / "src.tar.gz"
    bundle.write_bytes(_tar({"hello.txt": b"from the bundle\n"}))
    result = serve.cli("run", "--workspace", "b1", "--bundle", str(bundle), "--", "cat", "hello.txt")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"from the bundle\n"
    sha = hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert (serve.state_dir / "bundles" / sha).exists()
    # the guard walks b1 GUARD_DELAY_S after the job's end; a listing during that walk
    # answers from the sizes known before it, none for a new workspace (docs/disk.md): on
    # a loaded host it came then (stop 81)
    def measured():
        rows = serve.cli_json("workspaces")
        return rows if rows[0]["complete"] is not None else None

    rows = wait_for(measured, what="b1 measured", interval=0.1)
    assert [r["name"] for r in rows] == ["b1"] and rows[0]["complete"] is True


def test_job_submitted_before_its_bundle_waits_then_runs(tmp_path, serve):
    data = _tar({"x.txt": b"late\n"})
    sha = hashlib.sha256(data).hexdigest()
    with _http(serve) as http:
        resp = http.post("/v1/jobs", json={"command": ["cat", "x.txt"], "workspace": "late",
                                           "bundle_sha256": sha})
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
        time.sleep(0.3)
        assert http.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"
        bad = http.put(f"/v1/bundles/{sha}", content=data + b"tampered")
        assert bad.status_code == 400 and "mismatch" in bad.json()["detail"]
        assert not (serve.state_dir / "bundles" / sha).exists()
        health = http.get("/v1/health").json()  # a refused upload is an answer, not a crash
        assert health["status"] == "ok", health["degraded"]
        assert http.put(f"/v1/bundles/{sha}", content=data).status_code == 201
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            record = http.get(f"/v1/jobs/{job_id}").json()
            if record["state"] == "succeeded":
                break
            time.sleep(0.05)
        assert record["state"] == "succeeded"
    assert [n for n in os.listdir(serve.state_dir / "bundles") if ".partial." in n] == []


def test_unsafe_bundle_ends_the_job_with_workspace_setup_failed(tmp_path, serve):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    bundle = tmp_path / "evil.tar"
    bundle.write_bytes(buf.getvalue())
    result = serve.cli("run", "--workspace", "e", "--bundle", str(bundle), "--", "true")
    assert result.returncode == 75
    assert "workspace_setup_failed" in result.stderr.decode()
    assert not (serve.state_dir / "workspaces" / "escape").exists()
    assert not (serve.state_dir / "escape").exists()
