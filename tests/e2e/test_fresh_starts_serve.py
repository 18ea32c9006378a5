"""Through `motor serve` and its CLI (docs/keeper.md, "What a job's actor looks at before the
set-up"): a job this runner accepted and never started does not look in its job directory
before its set-up (an admit, and since stop 66 a job from its queue); a job an earlier runner
accepted, and a job adopted at the start, do. The `setup.look` fault point marks each look
(its `wait:` gate is already open: `GATE.reached` is made, nothing waits)."""

from __future__ import annotations

import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e


def test_serve_skips_the_look_only_for_the_jobs_it_accepted_itself(serve_factory, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    reached = tmp_path / "gate.reached"
    state = tmp_path / "state"

    def runner():
        serve = serve_factory("--isolation", "none", "--max-weight", "1", state_dir=state)
        serve.env = {"MOTOR_FAULTS": f"setup.look=wait:{gate}"}
        return serve.start()

    def waiting_job(serve, workspace, release):
        return serve.cli_json("submit", "--weight", "1", "--workspace", workspace, "--", "sh",
                              "-c", f"while [ ! -e {release} ]; do sleep 0.02; done")["job_id"]

    def state_of(serve, job_id):
        return {j["job_id"]: j["state"] for j in serve.cli_json("jobs", "--all")}.get(job_id)

    first_go, earlier_go = tmp_path / "first.go", tmp_path / "earlier.go"
    serve = runner()
    first = waiting_job(serve, "a", first_go)  # an admit: fresh
    wait_for(lambda: state_of(serve, first) == "running", what="the first job running")
    earlier = waiting_job(serve, "b", earlier_go)  # queued behind it (max weight 1)
    assert state_of(serve, earlier) == "queued"
    assert serve.stop() == 0  # the first job runs on under keeperd
    assert not reached.exists()  # nothing looked: the admit is fresh, the queued never started

    serve = runner()  # adopts the first: that start looks
    wait_for(reached.exists, what="the adoption's look")
    reached.unlink()
    later = serve.cli_json("submit", "--weight", "1", "--workspace", "c", "--", "true")["job_id"]
    assert state_of(serve, later) == "queued"
    first_go.touch()
    wait_for(lambda: state_of(serve, earlier) == "running", what="the earlier runner's job")
    assert reached.exists()  # accepted by the earlier runner: it may have been set up there
    reached.unlink()
    earlier_go.touch()
    wait_for(lambda: state_of(serve, later) == "succeeded", what="this runner's queued job")
    assert not reached.exists()  # accepted by this runner, never started: no look
    assert {state_of(serve, j) for j in (first, earlier)} == {"succeeded"}
    assert serve.stop() == 0
