"""The queue-wait rule end to end: heartbeats, the client's local deadline, withdraw."""

from __future__ import annotations

import pytest

import time

from polling import json_lines, wait_for

pytestmark = pytest.mark.e2e


def hold_capacity(serve, barrier):
    """A job holding every permit of a `--max-weight 1` runner until the barrier appears."""
    job = serve.cli_json("submit", "--weight", "1", "--workspace", "holder", "--",
                         "sh", "-c", f"while [ ! -e {barrier} ]; do sleep 0.01; done")
    wait_for(lambda: serve.cli_json("status")["running"], what="the holder to run")
    return job


def test_zero_queue_wait_withdraws_and_cancel_is_idempotent_end_to_end(serve_factory, tmp_path):
    serve = serve_factory("--max-weight", "1").start()
    holder = hold_capacity(serve, tmp_path / "go")
    result = serve.cli("run", "--json", "--weight", "1", "--workspace", "w",
                       "--queue-wait-limit", "0", "--", "true")
    assert result.returncode == 75, result.stderr
    assert result.stderr.decode().startswith("motor: refused: queue_wait_exceeded: ")
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "refused_before_start" and record["reason"] == "queue_wait_exceeded"
    for _ in range(2):  # cancel is idempotent, on an ended job too
        assert serve.cli("cancel", record["job_id"]).returncode == 0
    assert serve.cli_json("jobs", "--all")[0]["state"] in ("refused_before_start", "running")
    # withdrawing it again is refused, naming what happened: never a second "withdrawn"
    again = serve.cli("withdraw", record["job_id"])
    assert again.returncode != 0 and again.stdout == b""
    assert again.stderr.decode().startswith("motor: refused: already_ended: "), again.stderr
    assert "refused_before_start" in again.stderr.decode()
    # the runner-enforced path (motor submit, nobody follows): withdrawn within a tick
    job = serve.cli_json("submit", "--weight", "1", "--workspace", "w2",
                         "--queue-wait-limit", "0", "--", "true")
    ended = wait_for(lambda: _terminal(serve, job["job_id"]), what="the runner to withdraw it")
    assert (ended["state"], ended["reason"]) == ("refused_before_start", "queue_wait_exceeded")
    assert ended["queue_wait_ms"] < 1000 and ended["started_at_ms"] is None
    assert ended["ended_at_ms"] - ended["accepted_at_ms"] < 5000  # not the 60 s aging tick
    for _ in range(2):
        assert serve.cli("cancel", job["job_id"]).returncode == 0
    (tmp_path / "go").write_text("")
    assert serve.cli("attach", holder["job_id"]).returncode == 0


def _terminal(serve, job_id: str) -> dict | None:
    record = _record(serve, job_id)
    return record if record["state"] not in ("queued", "setup", "running") else None


def _record(serve, job_id: str) -> dict:
    return next(r for r in serve.cli_json("jobs", "--all") if r["job_id"] == job_id)


def test_a_claim_above_max_weight_waits_says_why_and_blocks_no_one(serve_factory, tmp_path):
    """max_weight is a hard bound: a claim above it (within the 2-CPU claim limit) is
    accepted and waits, even on an idle host; status says why; its budget applies."""
    serve = serve_factory("--max-weight", "1").start()
    big = serve.cli_json("submit", "--weight", "2", "--workspace", "big", "--", "true")
    small = serve.cli_json("submit", "--weight", "1", "--workspace", "small", "--", "echo", "ran")
    assert serve.cli("attach", small["job_id"]).returncode == 0  # it blocks no one
    status = serve.cli_json("status")  # the host is idle now, and the big claim still waits
    assert status["running"] == [] and status["capacity"]["held_permits"] == 0
    [queued] = status["queued"]
    assert queued["job_id"] == big["job_id"] and queued["waiting_on"] == "permits"
    assert "claim 2 vCPUs exceeds max_weight 1" in queued["waiting_detail"]
    plain = serve.cli("status")
    assert b"exceeds" in plain.stdout and b"max_weight" in plain.stdout, plain.stdout
    # its queue-wait budget applies as for any wait
    limited = serve.cli_json("submit", "--weight", "2", "--workspace", "big2",
                             "--queue-wait-limit", "1", "--", "true")
    ended = wait_for(lambda: _terminal(serve, limited["job_id"]), what="its budget to run out")
    assert ended["reason"] == "queue_wait_exceeded" and ended["started_at_ms"] is None
    assert "exceeds max_weight 1" in ended["detail"]
    assert serve.cli("cancel", big["job_id"]).returncode == 0


def test_heartbeats_stream_queue_wait_and_the_client_withdraws_at_its_local_deadline(
        serve_factory, tmp_path):
    serve = serve_factory("--max-weight", "1").start()
    holder = hold_capacity(serve, tmp_path / "go")
    result = serve.cli("run", "--json", "--weight", "1", "--workspace", "w",
                       "--queue-wait-limit", "2", "--", "true")
    assert result.returncode == 75, result.stderr
    events = json_lines(result.stdout)
    beats = [e for e in events if e["event"] == "queued"]
    assert len(beats) >= 2
    assert all(b["queue_wait_budget_ms"] == 2000 for b in beats)
    assert all(b["waiting_on"] == "permits" for b in beats[1:])
    waits = [b["queue_wait_ms"] for b in beats]
    assert waits == sorted(waits) and waits[-1] > 0
    terminal = events[-1]["record"]
    assert terminal["reason"] == "queue_wait_exceeded"
    assert terminal["queue_wait_ms"] >= 1500
    (tmp_path / "go").write_text("")
    assert serve.cli("attach", holder["job_id"]).returncode == 0


def test_a_job_behind_its_workspace_owner_is_not_withdrawn(serve_factory, tmp_path):
    """Waiting on the same workspace's owner does not spend the budget: the client never
    withdraws it, and it runs once the owner is done."""
    serve = serve_factory().start()
    barrier = tmp_path / "go"
    owner = serve.cli_json("submit", "--workspace", "w", "--",
                           "sh", "-c", f"while [ ! -e {barrier} ]; do sleep 0.01; done")
    wait_for(lambda: serve.cli_json("status")["running"], what="the owner to run")
    follower = serve.cli_popen("run", "--workspace", "w", "--queue-wait-limit", "1",
                               "--", "echo", "ran", json_output=True)
    # let its 1 s budget pass several times over while it waits on the owner
    wait_for(lambda: any(q["waiting_on"] == "workspace_owner" for q in serve.cli_json("status")["queued"]),
             what="the follower to queue")
    time.sleep(2.5)  # real time passing is the point here: the budget must not be spent
    status = serve.cli_json("status")["queued"][0]
    assert status["waiting_on"] == "workspace_owner"
    assert status["waiting_on_job"] == owner["job_id"]
    assert status["queue_wait_ms"] < 1000
    barrier.write_text("")
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert json_lines(out)[-1]["record"]["state"] == "succeeded"



def test_a_clock_that_resumed_while_queued_counts_the_runners_downtime(serve_factory, tmp_path):
    """Through `motor serve`, a clock that changed course after its job was accepted is what
    a restart resumes: C waits paused behind A, the owner of its workspace; when A ends, a
    gate job G takes the freed permit first, so C stays queued and its clock resumes (saved
    as a clock row, docs/scheduling.md "Where a clock is stored"). The runner is killed -9
    and stays down 4 s: C's clock was advancing, so the downtime is queue wait (its record
    as accepted says paused: resuming from it would not count it)."""
    serve = serve_factory("--max-weight", "2", "--isolation", "none").start()
    gates = {name: tmp_path / name for name in ("a", "d", "g")}

    def submit(name, workspace, *extra):
        return serve.cli_json("submit", "--weight", "1", "--workspace", workspace, *extra, "--",
                              "sh", "-c", f"while [ ! -e {gates[name]} ]; do sleep 0.01; done")

    def queued(job):
        return {q["job_id"]: q for q in serve.cli_json("status")["queued"]}.get(job["job_id"])

    a = submit("a", "w")
    submit("d", "y")
    wait_for(lambda: len(serve.cli_json("status")["running"]) == 2, what="A and D to run")
    c = serve.cli_json("submit", "--weight", "1", "--workspace", "w", "--", "true")
    wait_for(lambda: (queued(c) or {}).get("waiting_on_job") == a["job_id"], what="C behind A")
    assert queued(c)["waiting_on"] == "workspace_owner"
    g = submit("g", "gw", "--gate")
    gates["a"].write_text("")  # A ends: G (a gate job) takes its permit, C waits for capacity
    wait_for(lambda: g["job_id"] in [r["job_id"] for r in serve.cli_json("status")["running"]],
             what="G to run")
    assert queued(c)["waiting_on"] == "permits"
    serve.kill9()
    time.sleep(4)  # real downtime is the point: C's clock was advancing, so it counts
    serve.start()
    gates["g"].write_text("")
    gates["d"].write_text("")
    result = serve.cli("attach", "--json", c["job_id"])
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "succeeded", record
    assert record["queue_wait_ms"] >= 4000, record


def test_clocks_behind_a_workspace_drained_job_after_job_stay_paused(serve_factory, tmp_path):
    """Through `motor serve` (issue 14: an end and the next start at one instant flip no
    clock behind): A, B and C queue in one workspace; when A ends, B starts in the same
    message and C's clock stays paused behind B while real time passes, as it was behind
    A; C runs after B with the waits behind both owners not counted."""
    serve = serve_factory("--max-weight", "2", "--isolation", "none").start()
    gates = {name: tmp_path / name for name in ("a", "b")}

    def submit(name):
        return serve.cli_json("submit", "--weight", "1", "--workspace", "w", "--",
                              "sh", "-c", f"while [ ! -e {gates[name]} ]; do sleep 0.01; done")

    def queued(job):
        return {q["job_id"]: q for q in serve.cli_json("status")["queued"]}.get(job["job_id"])

    a = submit("a")
    wait_for(lambda: serve.cli_json("status")["running"], what="A to run")
    b = submit("b")
    c = serve.cli_json("submit", "--weight", "1", "--workspace", "w", "--", "true")
    wait_for(lambda: (queued(c) or {}).get("waiting_on_job") == a["job_id"], what="C behind A")
    time.sleep(1.0)  # real time passing is the point: behind an owner, it is not queue wait
    gates["a"].write_text("")  # A ends: B takes the workspace at once
    wait_for(lambda: (queued(c) or {}).get("waiting_on_job") == b["job_id"], what="C behind B")
    before = queued(c)
    time.sleep(1.5)
    after = queued(c)
    assert after["waiting_on"] == "workspace_owner"
    assert after["queue_wait_ms"] - before["queue_wait_ms"] < 200, (before, after)
    gates["b"].write_text("")
    result = serve.cli("attach", "--json", c["job_id"])
    record = json_lines(result.stdout)[-1]["record"]
    assert record["state"] == "succeeded" and record["queue_wait_ms"] < 1000, record


def test_a_job_cancelled_while_queued_records_the_wait_it_had(serve_factory, tmp_path):
    """Through `motor serve` and the CLI: a job waiting for capacity (its clock advancing)
    and cancelled records the queue wait it had then, in its terminal record and in the
    terminal event a follower reads; not the value saved when it was accepted (0)."""
    serve = serve_factory("--max-weight", "1").start()
    holder = hold_capacity(serve, tmp_path / "go")
    job = serve.cli_json("submit", "--weight", "1", "--workspace", "w", "--", "true")
    wait_for(lambda: (_record(serve, job["job_id"])["queue_wait_ms"] or 0) >= 1200,
             what="its clock to pass 1.2 s")
    assert serve.cli("cancel", job["job_id"]).returncode == 0
    ended = wait_for(lambda: _terminal(serve, job["job_id"]), what="it to end")
    assert (ended["state"], ended["reason"]) == ("cancelled", "cancelled")
    assert ended["queue_wait_ms"] >= 1200, ended
    result = serve.cli("attach", "--json", job["job_id"])
    assert json_lines(result.stdout)[-1]["record"]["queue_wait_ms"] == ended["queue_wait_ms"]
    (tmp_path / "go").write_text("")
    assert serve.cli("attach", holder["job_id"]).returncode == 0


def test_a_listing_shows_a_queued_jobs_live_wait_as_a_get_does(serve_factory, tmp_path):
    """`motor jobs` (GET /v1/jobs) shows a queued job as `GET /v1/jobs/{id}` and `motor
    status` do: its live queue_wait_ms and waiting_on, not the values saved when it was
    accepted (0, nothing)."""
    serve = serve_factory("--max-weight", "1").start()
    holder = hold_capacity(serve, tmp_path / "go")
    job = serve.cli_json("submit", "--weight", "1", "--workspace", "w", "--", "true")
    time.sleep(1.2)  # real time passing is the point: its clock advances, waiting on permits
    for listing in (serve.cli_json("jobs"), serve.cli_json("jobs", "--all")):
        listed = next(r for r in listing if r["job_id"] == job["job_id"])
        assert listed["state"] == "queued" and listed["waiting_on"] == "permits", listed
        assert listed["queue_wait_ms"] >= 1000, listed
    (tmp_path / "go").write_text("")
    assert serve.cli("attach", job["job_id"]).returncode == 0
    assert serve.cli("attach", holder["job_id"]).returncode == 0
