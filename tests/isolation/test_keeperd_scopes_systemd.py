"""keeperd starts systemd jobs' scopes itself, over one long-lived D-Bus connection
(motor/execution/sdscopes.py), inside the namespaced systemd harness (systemd_ns.py):
each job is in its scope from its first instruction, many jobs share one connection, and a
manager that closes the connection (daemon-reexec) is survived by reconnecting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from systemd_ns import KEEPERD_SCRIPT_HEAD, SystemdNamespace, unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(unavailable() is not None,
                                                  reason=f"systemd harness: {unavailable()}")]

ROOT = Path(__file__).resolve().parents[2]

#: Run inside the namespace: prepare N jobs' slices, write their job dirs (the job is
#: `cat /proc/self/cgroup`: its first instructions run in the unit it reports), ask
#: keeperd for all of them at once, wait, report. With "reexec", systemd re-executes
#: itself (closing every connection) after the first batch, and a second batch follows.
SCRIPT = KEEPERD_SCRIPT_HEAD + r"""
n, mode = int(sys.argv[2]), sys.argv[3]

def request_all(reqs):
    global buf
    sock.sendall(b"".join(json.dumps(r).encode() + b"\n" for r in reqs))
    got = {}
    while len(got) < len(reqs):
        while b"\n" not in buf:
            buf += sock.recv(65536)
        line, _, buf = buf.partition(b"\n")
        msg = json.loads(line)
        got[msg["id"]] = msg
    return got

def batch(tag):
    jobs = []
    for i in range(n):
        job = str(uuid.uuid4())
        fields = backend.prepare(job, None, None)
        d = os.path.join(state, "jobs", f"{tag}{i}")
        os.makedirs(d)
        spec = {"job_id": job, "command": ["cat", "/proc/self/cgroup"], "cwd": "/",
                "env": dict(os.environ), "cpus": None, "timeout_s": 60.0, "kill_grace_s": 1.0}
        spec.update(fields)
        write_json_atomic(os.path.join(d, "spec.json"), spec)
        jobs.append((job, d))
    holder = None
    if mode == "taken":  # someone else holds the first job's scope name: systemd refuses it
        name = job_scope("motor-jobs", jobs[0][0])
        holder = subprocess.Popen(["systemd-run", "--scope", "--quiet", "--unit=" + name,
                                   "sleep", "60"])
        while subprocess.run(["systemctl", "is-active", "--quiet", name]).returncode:
            time.sleep(0.01)
    spawned = request_all([{"id": i, "op": "spawn", "job_dir": d} for i, (_, d) in enumerate(jobs)])
    request_all([{"id": i, "op": "wait", "job_dir": d} for i, (_, d) in enumerate(jobs)])
    out = []
    for i, (job, d) in enumerate(jobs):
        recs, _ = read_records(os.path.join(d, "output.log"))
        text = b"".join(data for stream, data in recs if stream == "stdout").decode()
        unit = [l.split(":", 2)[2] for l in text.splitlines() if ":name=systemd:" in l]
        status = read_status(d)
        out.append({"spawn": spawned[i], "exit_code": status["exit_code"],
                    "reason": status.get("reason"), "detail": status.get("detail"),
                    "unit": unit[0] if unit else None, "scope": job_scope("motor-jobs", job)})
        backend.finish(job)
    if holder is not None:
        holder.kill()
        holder.wait()
    return out

def keeperd_log():
    path = os.path.join(state, "keeperd.log")
    return open(path).read() if os.path.exists(path) else ""

result = {}
if mode in ("prepared", "prepare-fails"):  # a runner's start, before any job
    address = backend.address if mode == "prepared" else os.path.join(work, "no-bus")
    result["prepare"] = request_all([{"id": 0, "op": "prepare", "systemd_address": address}])[0]
    result["log_before"] = keeperd_log()
result["first"] = batch("a")
if mode == "reexec":
    backend.pool.close()  # this script's own idle connection would break too
    subprocess.run(["systemctl", "daemon-reexec"], check=True)
    result["second"] = batch("b")
result["log"] = keeperd_log()
sock.close()
print(json.dumps(result))
"""


def run_script(ns: SystemdNamespace, tmp_path: Path, n: int, mode: str) -> dict:
    work = tmp_path / "work"
    work.mkdir()
    result = ns.run(sys.executable, "-c", SCRIPT, str(work), str(n), mode, cwd=str(ROOT),
                    timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def connections_opened(log: str) -> int:
    return sum(1 for line in log.splitlines() if "systemd: connection" in line and "opened" in line)


def assert_in_own_scope(jobs: list[dict]) -> None:
    for job in jobs:
        assert job["exit_code"] == 0 and job["reason"] is None, job
        assert job["spawn"]["job_pid"], job
        assert job["unit"] is not None and job["unit"].endswith("/" + job["scope"]), job


def test_keeperd_starts_each_jobs_scope_over_one_connection(systemd_ns, tmp_path):
    out = run_script(systemd_ns, tmp_path, 12, "once")
    # `cat` read /proc/self/cgroup as the job: it was in its own scope from the start
    assert_in_own_scope(out["first"])
    assert len({job["unit"] for job in out["first"]}) == 12
    # twelve jobs asked for at once, one connection to the manager between them
    assert connections_opened(out["log"]) == 1, out["log"]


def test_keeperd_reconnects_after_systemd_closed_its_connection(systemd_ns, tmp_path):
    out = run_script(systemd_ns, tmp_path, 3, "reexec")
    assert_in_own_scope(out["first"])
    # daemon-reexec closed every connection: the next jobs open a new one and run
    assert_in_own_scope(out["second"])
    assert connections_opened(out["log"]) == 2, out["log"]


def test_a_scope_systemd_refuses_fails_that_job_spawn_failed_and_the_rest_run(
        systemd_ns, tmp_path):
    out = run_script(systemd_ns, tmp_path, 3, "taken")
    refused, *others = out["first"]
    assert refused["reason"] == "spawn_failed" and refused["spawn"]["job_pid"] is None, refused
    assert "did not start the job's scope" in refused["detail"], refused
    assert "UnitExists" in refused["detail"], refused
    assert_in_own_scope(others)  # the same connection serves the jobs after it
    assert connections_opened(out["log"]) == 1, out["log"]


def test_keeperd_prepared_for_systemd_connects_before_the_first_job(systemd_ns, tmp_path):
    """A systemd runner's start asks keeperd to "prepare" (stop 63): the D-Bus client is
    imported and its connection opened then, which keeperd's first systemd job did before
    (about 35 ms of it). The jobs then use that connection."""
    out = run_script(systemd_ns, tmp_path, 3, "prepared")
    assert out["prepare"]["prepared"] == ["systemd"], out["prepare"]
    assert connections_opened(out["log_before"]) == 1, out["log_before"]
    assert_in_own_scope(out["first"])
    assert connections_opened(out["log"]) == 1, out["log"]


def test_a_prepare_that_cannot_connect_is_logged_and_the_jobs_connect_themselves(
        systemd_ns, tmp_path):
    out = run_script(systemd_ns, tmp_path, 2, "prepare-fails")
    assert out["prepare"]["prepared"] == [] and out["prepare"]["error"], out["prepare"]
    assert "cannot prepare the connection to systemd" in out["log_before"], out["log_before"]
    assert_in_own_scope(out["first"])  # their specs name the manager: it connects then
    assert connections_opened(out["log"]) == 1, out["log"]
