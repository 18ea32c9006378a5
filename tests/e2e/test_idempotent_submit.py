"""End to end: idempotent submits through a real `python -m motor serve` (docs/protocol.md,
"Idempotent submits"): a submit with an idempotency key a retained job was accepted with is
answered with that job, across restarts and crashes, and `motor run`/`motor submit` send a
submit again whose answer a crash swallowed, making one job, not two."""

from __future__ import annotations

import json

import pytest
from polling import wait_for

from motor.client import Client, RunnerUnavailable
from motor.records import TERMINAL_STATES, RefusedError

pytestmark = pytest.mark.e2e


def ended(client: Client, job_id: str) -> dict | None:
    record = client.call("GET", f"/v1/jobs/{job_id}")
    return record if record["state"] in TERMINAL_STATES else None


def test_a_key_answers_with_its_job_in_every_state_and_after_a_restart(serve, tmp_path):
    marker = tmp_path / "runs"
    job = {"command": ["sh", "-c", f"echo ran >> {marker}"], "workspace": "idem", "weight_hint": 1,
           "idempotency_key": "build-42"}
    with Client(serve.socket) as client:
        first = client.submit(job, raw=True)
        assert first["idempotency_key"] == "build-42"
        again = client.submit(job, raw=True)  # queued or running: the same job
        assert again["job_id"] == first["job_id"]
        record = wait_for(lambda: ended(client, first["job_id"]), what="the job to end")
        assert record["state"] == "succeeded"
        # ended: still the same job, as it ended; nothing runs again
        assert client.submit(job, raw=True)["job_id"] == first["job_id"]
        # another request under the same key is refused, naming the job
        with pytest.raises(RefusedError) as refused:
            client.submit({**job, "command": ["sh", "-c", "rm -rf /"]}, raw=True)
        assert refused.value.refusal.code == "idempotency_key_reused"
        assert first["job_id"] in refused.value.refusal.detail
        # a malformed key is a bad request
        for bad in ("", "has space", "x" * 129, "é"):
            with pytest.raises(RefusedError) as malformed:
                client.submit({**job, "idempotency_key": bad}, raw=True)
            assert malformed.value.refusal.code == "bad_request", bad
        # a batch: items with the key answered with the job, a new key makes a new job
        answers = client.call("POST", "/v1/jobs", json=[job, {**job, "idempotency_key": "build-43"},
                                                        {**job, "idempotency_key": "build-43"}])
        assert answers[0]["job_id"] == first["job_id"]
        assert answers[1]["job_id"] != first["job_id"] and answers[2]["job_id"] == answers[1]["job_id"]
        wait_for(lambda: ended(client, answers[1]["job_id"]), what="the second job to end")
    serve.stop()
    serve.start()
    with Client(serve.socket) as client:  # the keys are in the job database
        assert client.submit(job, raw=True)["job_id"] == first["job_id"]
        jobs = client.call("GET", "/v1/jobs", params={"all": "1"})
        assert sorted(j["job_id"] for j in jobs) == sorted({first["job_id"], answers[1]["job_id"]})
    assert marker.read_text() == "ran\nran\n"  # build-42 once, build-43 once


def test_the_idempotency_key_header_names_a_single_submit(serve):
    import http.client
    import socket

    class UnixHTTPConnection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(serve.socket))

    def post(body: dict, key: str) -> tuple[int, dict]:
        conn = UnixHTTPConnection("motor")
        conn.request("POST", "/v1/jobs", body=json.dumps(body),
                     headers={"content-type": "application/json", "idempotency-key": key})
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        return response.status, answer

    status, first = post({"command": ["true"], "weight_hint": 1}, "hdr-1")
    assert status == 202 and first["idempotency_key"] == "hdr-1"
    status, again = post({"command": ["true"], "weight_hint": 1}, "hdr-1")
    assert status == 202 and again["job_id"] == first["job_id"]
    status, both = post({"command": ["true"], "weight_hint": 1, "idempotency_key": "other"}, "hdr-1")
    assert status == 400 and both["code"] == "bad_request" and "differ" in both["detail"]


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_runner_that_crashes_before_answering_a_submit_runs_the_job_once(serve_factory, tmp_path, command):
    """The runner accepts and records the job, then dies (SIGKILL at `api.submitted`) before
    its answer is sent. The CLI sends the submit again with the same key until a runner
    answers; the restarted runner answers with the job it recorded: one job, run once."""
    serve = serve_factory()
    serve.env = {"MOTOR_FAULTS": "api.submitted=kill"}
    serve.start()
    marker = tmp_path / "runs"
    cli = serve.cli_popen(command, "--weight", "1", "--", "sh", "-c", f"echo ran >> {marker}; echo hello")
    wait_for(lambda: serve.proc.poll() is not None, what="the runner to kill itself at api.submitted")
    assert cli.poll() is None  # still trying
    serve.env = {}
    serve.start()
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err.decode()
    with Client(serve.socket) as client:
        [job] = client.call("GET", "/v1/jobs", params={"all": "1"})
        wait_for(lambda: ended(client, job["job_id"]), what="the job to end")
        assert ended(client, job["job_id"])["state"] == "succeeded"
    assert job["idempotency_key"]  # the CLI's own key
    if command == "run":
        assert out.decode() == "hello\n"
    else:
        assert out.decode().strip() == job["job_id"]
    assert marker.read_text() == "ran\n"


def test_without_a_key_a_swallowed_answer_is_not_sent_again(serve_factory, tmp_path):
    """The typed client, no key: the broken connection is reported (sent=True), not retried."""
    serve = serve_factory()
    serve.env = {"MOTOR_FAULTS": "api.submitted=kill"}
    serve.start()
    with Client(serve.socket) as client:
        with pytest.raises(RunnerUnavailable) as gone:
            client.submit({"command": ["true"]}, retry_s=30)
        assert gone.value.sent
    serve.proc.wait(10)  # it killed itself at api.submitted
    serve.env = {}
    serve.start()
    with Client(serve.socket) as client:
        assert len(client.call("GET", "/v1/jobs", params={"all": "1"})) == 1


def test_the_cli_says_which_key_makes_a_retry_safe_when_no_runner_comes_back(serve_factory, tmp_path):
    serve = serve_factory()
    serve.env = {"MOTOR_FAULTS": "api.submitted=kill"}
    serve.start()
    result = serve.cli("submit", "--idempotency-key", "mine-1", "--retry-for", "2", "--", "true")
    assert result.returncode == 69  # EX_UNAVAILABLE: no runner answered (docs/cli.md)
    err = result.stderr.decode()
    assert "--idempotency-key mine-1" in err and "may have accepted" in err
    serve.proc.wait(10)  # it killed itself at api.submitted
    serve.env = {}
    serve.start()
    again = serve.cli("submit", "--idempotency-key", "mine-1", "--", "true", json_output=True)
    assert again.returncode == 0, again.stderr.decode()
    with Client(serve.socket) as client:
        [job] = client.call("GET", "/v1/jobs", params={"all": "1"})
    assert json.loads(again.stdout)["job_id"] == job["job_id"]
