"""End to end: batch submit through a real `python -m motor serve`: `POST /v1/jobs` with a
JSON list (each item answered in order, one refused item sinks nothing, a bad batch is
refused whole) and `motor submit --from FILE` (docs/protocol.md, docs/cli.md)."""

from __future__ import annotations

import json

import pytest
from polling import json_lines, wait_for

from motor.client import Client
from motor.records import TERMINAL_STATES, RefusedError

pytestmark = pytest.mark.e2e


def ended(client: Client, job_id: str) -> dict | None:
    record = client.call("GET", f"/v1/jobs/{job_id}")
    return record if record["state"] in TERMINAL_STATES else None


def output_of(client: Client, job_id: str) -> str:
    return "".join(e.get("data", "") for e in client.events(job_id, raw=True) if e["event"] == "output")


def test_a_list_is_answered_per_item_in_order_and_bad_items_sink_nothing(serve):
    batch = [
        {"command": ["sh", "-c", "echo first"], "workspace": "batch-a"},
        {"command": []},                                    # the runner refuses it
        7,                                                  # not a job request at all
        {"command": ["true"], "workspace": "../escape"},    # the runner refuses it
        {"workspace": "no-command"},                        # missing field
        {"command": ["sh", "-c", "echo last"], "workspace": "batch-b", "env": {"X": "é"}},
    ]
    with Client(serve.socket) as client:
        answers = client.call("POST", "/v1/jobs", json=batch)
        assert client.runner_capabilities == ["gate_jobs", "follow", "withdraw"]
        assert len(answers) == len(batch)
        first, empty, seven, escape, missing, last = answers
        assert first["state"] == "queued" and first["workspace"] == "batch-a" and "refused" not in first
        assert last["workspace"] == "batch-b" and last["command"] == ["sh", "-c", "echo last"]
        assert empty == {"refused": True, "code": "bad_request", "detail": "command must not be empty"}
        assert seven["refused"] and seven["code"] == "bad_request" and "Expected `object`" in seven["detail"]
        assert escape["code"] == "bad_request" and "not a plain name" in escape["detail"]
        assert missing["code"] == "bad_request" and "missing required field `command`" in missing["detail"]
        assert first["job_id"] < last["job_id"]  # accepted in order
        for job in (first, last):
            record = wait_for(lambda: ended(client, job["job_id"]), what=f"job {job['job_id']} to end")
            assert record["state"] == "succeeded", record
        assert output_of(client, first["job_id"]) == "first\n"
        assert output_of(client, last["job_id"]) == "last\n"
        # nothing was accepted for the refused items
        assert sorted(r["job_id"] for r in client.call("GET", "/v1/jobs")) == sorted(
            [first["job_id"], last["job_id"]])
        # the typed form: JobRecord or Refusal per item
        typed = client.submit_batch([{"command": ["true"]}, {"command": []}])
        assert type(typed[0]).__name__ == "JobRecord" and typed[0].state == "queued"
        assert type(typed[1]).__name__ == "Refusal" and typed[1].code == "bad_request"


def test_a_runner_refusal_answers_its_own_item_and_the_rest_are_still_accepted(serve_factory):
    serve = serve_factory("--max-weight", "1", "--max-queue-depth", "2", "--isolation", "none").start()
    with Client(serve.socket) as client:
        blocker = client.submit({"command": ["sleep", "60"], "workspace": "hold", "weight_hint": 1},
                                raw=True)
        wait_for(lambda: client.call("GET", f"/v1/jobs/{blocker['job_id']}")["state"] == "running",
                 what="the blocker to run")
        # the only slot is held: two jobs queue, the third finds the queue full
        answers = client.call("POST", "/v1/jobs", json=[{"command": ["true"], "workspace": f"q{i}",
                                                         "weight_hint": 1} for i in range(3)])
        assert [a.get("state") for a in answers[:2]] == ["queued", "queued"]
        assert answers[2]["refused"] and answers[2]["code"] == "runner_full", answers[2]
        client.call("POST", f"/v1/jobs/{blocker['job_id']}/cancel")
        for job in answers[:2]:
            record = wait_for(lambda: ended(client, job["job_id"]), what="a queued job to end")
            assert record["state"] == "succeeded", record


def test_a_bad_batch_is_refused_whole_and_the_runner_keeps_serving(serve):
    with Client(serve.socket) as client:
        cases = [
            (b'[{"command": ["true"]}', "bad_request", "malformed batch"),
            (b"[" + b",".join([b'{"command": ["true"]}'] * 1001) + b"]", "batch_too_large", "at most 1000 jobs"),
        ]
        for body, code, detail in cases:
            with pytest.raises(RefusedError) as info:
                client._send("POST", "/v1/jobs", content=body, headers={"content-type": "application/json"})
            assert info.value.refusal.code == code and detail in info.value.refusal.detail
        with pytest.raises(RefusedError) as info:
            client.call("POST", "/v1/jobs", json=[{"command": ["true"]}], params={"follow": "1"})
        assert info.value.refusal.code == "bad_request" and "follow=1 takes one job request" in info.value.refusal.detail
        with pytest.raises(RefusedError) as info:
            client.call("POST", "/v1/jobs", json=[])
        assert info.value.refusal.code == "bad_request" and "empty batch" in info.value.refusal.detail
        assert client.call("GET", "/v1/jobs") == []  # nothing of those was submitted
        assert client.health()["status"] in ("ok", "degraded")
        job = client.submit({"command": ["true"]}, raw=True)  # still serving
        assert job["state"] == "queued"
        # ended before the runner stops (a job the runner never finishes leaves its groups)
        wait_for(lambda: client.call("GET", f"/v1/jobs/{job['job_id']}")["state"] in TERMINAL_STATES,
                 what="the job to end")


def test_submit_from_a_json_lines_file_prints_one_line_per_job(serve, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        json.dumps({"command": ["sh", "-c", "echo one"], "workspace": "from-a"}) + "\n"
        "\n"  # blank lines are skipped
        + json.dumps({"command": ["true"], "workspace": "a/b"}) + "\n"
        + json.dumps({"command": ["sh", "-c", "echo three"], "workspace": "from-b"}) + "\n"
        "7\n")  # JSON, but not a job request: the runner refuses it
    result = serve.cli("submit", "--from", str(jobs))
    assert result.returncode == 65, result.stderr  # the first refusal's status: bad_request
    lines = result.stdout.decode().splitlines()
    assert len(lines) == 4 and lines[1] == lines[3] == "refused bad_request"
    err = result.stderr.decode().splitlines()
    assert err[0].startswith("motor: job [1]: refused: bad_request: workspace 'a/b'")
    assert err[1].startswith("motor: job [3]: refused: bad_request: Expected `object`") and len(err) == 2
    with Client(serve.socket) as client:
        for job_id, text in ((lines[0], "one\n"), (lines[2], "three\n")):
            assert wait_for(lambda: ended(client, job_id), what="a --from job to end")["state"] == "succeeded"
            assert output_of(client, job_id) == text


def test_submit_from_stdin_with_a_json_list_and_json_output(serve):
    body = json.dumps([{"command": ["true"], "workspace": f"stdin{i}"} for i in range(3)]).encode()
    result = serve.cli("submit", "--from", "-", input=body, json_output=True)
    assert result.returncode == 0, result.stderr
    answers = json_lines(result.stdout)
    assert [a["workspace"] for a in answers] == ["stdin0", "stdin1", "stdin2"]
    assert all(a["state"] == "queued" and a["job_id"] for a in answers)
    # an empty file is zero jobs: nothing to send, nothing printed, success
    result = serve.cli("submit", "--from", "-", input=b"\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


@pytest.mark.parametrize("args, text, needle", [
    ((), '{"command": ["true"]}\n{"command": ["true"\n', "line 2 is not JSON"),
    ((), '[{"command": ["true"]},', "not a JSON list"),
    ((), '{"command": ["true"], "timeout_s": Infinity}\n', "line 1 is not JSON: Infinity is not"),
    ((), '[{"command": ["true"], "timeout_s": NaN}]', "not a JSON list: NaN is not a JSON value"),
    (("--workspace", "w"), '{"command": ["true"]}\n', "takes the job options from FILE, not from --workspace"),
    (("--", "true"), '{"command": ["true"]}\n', "takes no command after --"),
])
def test_submit_from_bad_input_is_a_usage_error_and_submits_nothing(serve, tmp_path, args, text, needle):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(text)
    result = serve.cli("submit", "--from", str(jobs), *args)
    assert result.returncode == 2
    err = result.stderr.decode()
    assert err.startswith("motor: error: ") and needle in err and len(err.splitlines()) == 1, err
    with Client(serve.socket) as client:
        assert client.call("GET", "/v1/jobs") == []


async def test_the_embedded_runner_submits_many_with_the_same_rules(tmp_path):
    """`Runner.submit_many` (the facade the API calls): each request one submit, in order,
    its record or its Refusal; more than MAX_BATCH_JOBS is refused whole, nothing submitted."""
    import motor
    from motor.records import JobRequest, Refusal
    from motor.runner.facade import MAX_BATCH_JOBS
    from runner_helpers import embedded_config, terminal_of

    async with motor.open_runner(embedded_config(tmp_path)) as runner:
        answers = await runner.submit_many([
            JobRequest(command=["sh", "-c", "echo embedded"], workspace="emb"),
            JobRequest(command=[]),
            JobRequest(command=["true"], workspace="a/b"),
        ])
        assert [type(a).__name__ for a in answers] == ["JobRecord", "Refusal", "Refusal"]
        assert isinstance(answers[1], Refusal) and answers[1].code == "bad_request"
        assert (await terminal_of(runner, answers[0].job_id))["state"] == "succeeded"
        with pytest.raises(RefusedError) as info:
            await runner.submit_many([JobRequest(command=["true"])] * (MAX_BATCH_JOBS + 1))
        assert info.value.refusal.code == "batch_too_large"
        assert [r.job_id for r in await runner.jobs()] == [answers[0].job_id]
