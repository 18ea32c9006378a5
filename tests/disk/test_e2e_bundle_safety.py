"""Bundles through a real `motor serve`: a hostile tar refused at setup, and staging
leftovers of a runner killed mid-unpack swept at the next start-up."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import httpx
import pytest

from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def _http(serve) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)), base_url="http://motor")


def _tar(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, linkname, data in members:
            info = tarfile.TarInfo(name)
            if linkname is not None:
                info.type, info.linkname = tarfile.SYMTYPE, linkname
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _terminal(http, job_id) -> dict:
    resp = http.get(f"/v1/jobs/{job_id}/events", params={"from_seq": 0}, timeout=60)
    return json_lines(resp.content)[-1]["record"]


def test_bundle_symlink_resolving_outside_through_another_symlink_is_refused(tmp_path, serve):
    # s1 -> s2/.. is lexically inside, but s2 -> . makes it the workspace's parent
    data = _tar(("s1", "s2/..", None), ("s2", ".", None), ("ok.txt", None, b"x"))
    sha = hashlib.sha256(data).hexdigest()
    with _http(serve) as http:
        assert http.put(f"/v1/bundles/{sha}", content=data).status_code == 201
        resp = http.post("/v1/jobs", json={"command": ["ls", "s1/"], "workspace": "hostile",
                                           "bundle_sha256": sha})
        assert resp.status_code == 202, resp.text
        record = _terminal(http, resp.json()["job_id"])
        assert record["state"] == "refused_before_start", record
        assert record["reason"] == "workspace_setup_failed"
        assert "s1" in record["detail"] and "outside" in record["detail"]
        ws = serve.state_dir / "workspaces" / "hostile"
        assert not os.path.lexists(ws / "s1") and not os.path.lexists(ws / "ok.txt")
        assert os.listdir(serve.state_dir / "workspaces" / ".motor-staging") == []
        # the runner keeps serving bundles
        good = _tar(("hello.txt", None, b"hi\n"))
        good_sha = hashlib.sha256(good).hexdigest()
        assert http.put(f"/v1/bundles/{good_sha}", content=good).status_code == 201
        resp = http.post("/v1/jobs", json={"command": ["cat", "hello.txt"], "workspace": "hostile",
                                           "bundle_sha256": good_sha})
        assert _terminal(http, resp.json()["job_id"])["state"] == "succeeded"


def test_staging_left_by_a_runner_killed_mid_unpack_is_swept_at_start_up(
        tmp_path, serve_factory, monkeypatch):
    data = _tar(("src/main.c", None, b"int main(){}\n"), ("hello.txt", None, b"unpacked\n"))
    sha = hashlib.sha256(data).hexdigest()
    # held after extraction, then killed: the answer to the submit (sent as the job's
    # set-up begins, maybe after the extraction when the host is loaded) is not raced
    barrier = tmp_path / "extracted"
    monkeypatch.setenv("MOTOR_FAULTS", f"unpack.extracted=wait:{barrier}")
    serve = serve_factory().start()
    staging = serve.state_dir / "workspaces" / ".motor-staging"
    with _http(serve) as http:
        assert http.put(f"/v1/bundles/{sha}", content=data).status_code == 201
        resp = http.post("/v1/jobs", json={"command": ["cat", "hello.txt"], "workspace": "w",
                                           "bundle_sha256": sha})
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
    wait_for((tmp_path / "extracted.reached").exists, what="the unpack to be extracted")
    serve.proc.kill()  # the runner dies mid-unpack
    serve.proc.wait(timeout=30)
    assert serve.proc.returncode == -9
    leftovers = os.listdir(staging)
    assert len(leftovers) == 1 and leftovers[0].startswith(job_id)
    assert (staging / leftovers[0] / "src" / "hello.txt").exists()

    monkeypatch.delenv("MOTOR_FAULTS")
    serve.start()  # the sweep runs right after the disk actor's start (stop 61)
    wait_for(lambda: not os.path.lexists(staging / leftovers[0]), what="the start-up sweep")
    with _http(serve) as http:
        record = _terminal(http, job_id)  # the job set up again from the stored bundle
    assert record["state"] == "succeeded", record
    assert (serve.state_dir / "workspaces" / "w" / "hello.txt").read_text() == "unpacked\n"
    assert os.listdir(staging) == []


def test_a_queued_jobs_bundle_removed_while_the_runner_was_down_ends_it_at_its_setup(
        tmp_path, serve_factory):
    """A job queued with its bundle stored, the bundle then removed from <state>/bundles while
    the runner is down: the restarted runner sets the job up when its turn comes and ends
    it `refused_before_start` / `workspace_setup_failed` naming the bundle, as a runner that
    stayed up does. Before stop 55 recovery put it back to waiting for an upload that no
    client would send: queued for ever, waiting on nothing anyone could see."""
    barrier = tmp_path / "go"
    data = _tar(("hello.txt", None, b"hi\n"))
    sha = hashlib.sha256(data).hexdigest()
    serve = serve_factory().start()
    with _http(serve) as http:  # queued behind the job that owns its workspace
        blocker = http.post("/v1/jobs", json={
            "command": ["sh", "-c", f"while [ ! -e {barrier} ]; do sleep 0.01; done"],
            "workspace": "w", "weight_hint": 1}).json()["job_id"]
        assert http.put(f"/v1/bundles/{sha}", content=data).status_code == 201
        resp = http.post("/v1/jobs", json={"command": ["cat", "hello.txt"], "workspace": "w",
                                           "bundle_sha256": sha, "weight_hint": 1})
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["job_id"]
        assert http.get(f"/v1/jobs/{job_id}").json()["state"] == "queued"
    serve.kill9()
    (serve.state_dir / "bundles" / sha).unlink()
    serve.start()
    barrier.write_text("")
    with _http(serve) as http:
        assert _terminal(http, blocker)["state"] == "succeeded"
        record = wait_for(lambda: (r := http.get(f"/v1/jobs/{job_id}").json())["ended_at_ms"] and r,
                          what="the job to end", timeout=60)
    assert (record["state"], record["reason"]) == ("refused_before_start", "workspace_setup_failed")
    assert record["detail"] == f"bundle {sha} is no longer stored on the runner", record
