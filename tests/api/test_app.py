"""The ASGI app in-process (httpx.ASGITransport) against the fake runner."""

from __future__ import annotations

import logging

import httpx
import pytest
from fake_runner import FakeRunner

from motor.api import make_app
from motor.config import RunnerConfig
from motor.records import Refusal


def client_for(app, *, tcp: bool = False) -> httpx.AsyncClient:
    """In-process requests as if on the Unix socket (hypercorn gives those no `server`
    address), or, with `tcp=True`, as if over TCP (ASGITransport names a server address)."""
    if not tcp:
        inner = app

        async def app(scope, receive, send):
            await inner({**scope, "server": None}, receive, send)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://motor")


@pytest.fixture
def fake() -> FakeRunner:
    return FakeRunner(RunnerConfig(state_dir="/nonexistent/m", max_body_bytes=4096))


@pytest.fixture
async def http(fake):
    async with client_for(make_app(fake)) as c:
        yield c


def assert_refusal(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["refused"] is True
    assert body["code"] == code
    assert isinstance(body["detail"], str) and body["detail"]
    return body


async def test_lifespan_startup_and_shutdown(fake):
    app = make_app(fake)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message["type"])

    await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_submit_answers_202_with_record_and_capabilities(http, fake):
    resp = await http.post("/v1/jobs", json={"command": ["make", "-j4"], "workspace": "app",
                                            "env": {"SECRET": "x"}, "capabilities": ["gate_jobs"]})
    assert resp.status_code == 202
    assert resp.headers["motor-capabilities"] == "gate_jobs,follow,withdraw"
    body = resp.json()
    assert body["capabilities"] == ["gate_jobs", "follow", "withdraw"]
    assert body["command"] == ["make", "-j4"] and body["workspace"] == "app"
    assert "env" not in body  # public_record withholds env
    assert "reservation_use" not in body
    req, follow = fake.submitted[0]
    assert req.capabilities == ["gate_jobs"] and follow is False


async def test_get_and_list_jobs(http, fake):
    job_id = (await http.post("/v1/jobs", json={"command": ["true"]})).json()["job_id"]
    resp = await http.get(f"/v1/jobs/{job_id}")
    assert resp.status_code == 200 and resp.json()["job_id"] == job_id
    assert resp.json()["state"] == "succeeded"
    listing = await http.get("/v1/jobs")
    assert [r["job_id"] for r in listing.json()] == [job_id]
    await http.get("/v1/jobs?all=1")
    assert fake.jobs_calls == [False, True]
    assert_refusal(await http.get("/v1/jobs?all=maybe"), 400, "bad_request")


async def test_unknown_job_is_404_not_found(http):
    assert_refusal(await http.get("/v1/jobs/nope"), 404, "not_found")
    assert_refusal(await http.post("/v1/jobs/nope/cancel"), 404, "not_found")


async def test_cancel_and_withdraw(http, fake):
    job_id = (await http.post("/v1/jobs", json={"command": ["true"]})).json()["job_id"]
    resp = await http.post(f"/v1/jobs/{job_id}/withdraw")
    assert resp.status_code == 200 and resp.json() == {"result": "withdrawn"}
    fake.withdraw_result = "started"
    assert (await http.post(f"/v1/jobs/{job_id}/withdraw")).json() == {"result": "started"}
    resp = await http.post(f"/v1/jobs/{job_id}/cancel")
    assert resp.status_code == 200 and resp.json()["job_id"] == job_id


async def test_read_only_routes(http):
    health = await http.get("/v1/health")
    assert health.status_code == 200 and health.json()["isolation"] == "none"
    status = await http.get("/v1/status")
    assert set(status.json()) >= {"queued", "running"}
    assert (await http.get("/v1/status?full=1")).status_code == 200
    assert_refusal(await http.get("/v1/status?full=maybe"), 400, "bad_request")
    ws = await http.get("/v1/workspaces")
    assert ws.json()[0]["name"] == "default"
    metrics = await http.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "motor_jobs_total 0" in metrics.text
    index = await http.get("/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert "<title>motor</title>" in index.text and 'href="/v1/health"' in index.text
    assert index.headers["motor-capabilities"] == "gate_jobs,follow,withdraw"


@pytest.mark.parametrize(
    "body, detail_part",
    [
        (b"{not json", "malformed"),
        (b"", "malformed"),
        (b'{"command": "make"}', "Expected `array`, got `str` - at `$.command`"),
        (b'{"workspace": "x"}', "missing required field `command`"),
        (b'"make"', "Expected `object`"),
        (b'[{"command": ["make"]}', "malformed batch"),  # a list is a batch submit: this one is cut short
        (b'{"command": ["make"]}]', "malformed"),
        (b'{"command": []}', "command must not be empty"),
        (b'{"command": ["make"], "workspace": ".."}', "not a plain name"),
        (b'{"command": ["make"], "workspace": "a/b"}', "not a plain name"),
        (b'{"command": ["make"], "workspace": "/abs/../x"}', "not a plain name"),
        (b'{"command": ["make"], "weight_hint": "four"}', "Expected `int | null`"),
        (b'{"command": ["make"], "timeout_s": -1}', "timeout_s"),
        (b'{"command": ["ma\\u0000ke"]}', "command arguments must not contain NUL bytes"),
        (b'{"command": ["make"], "siblings": [%s]}' % b",".join(b'"s%d"' % i for i in range(257)),
         "siblings: 257 named, at most 256"),
        (b'{"command": ["make"], "env": {"A=B": "1"}}', "env key 'A=B' is not a valid variable name"),
        (b'{"command": ["make"], "env": {"A": "1\\u00002"}}', "env value of 'A' must not contain NUL"),
    ],
)
async def test_bad_requests_are_400(http, fake, body, detail_part):
    resp = await http.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    refusal = assert_refusal(resp, 400, "bad_request")
    assert detail_part in refusal["detail"]
    assert fake.submitted == []


async def test_non_json_content_is_a_bad_request(http):
    resp = await http.post("/v1/jobs", content=b"command=make", headers={"content-type": "text/plain"})
    assert_refusal(resp, 400, "bad_request")


async def test_body_over_the_limit_is_413_by_content_length(http, fake):
    resp = await http.post("/v1/jobs", json={"command": ["echo", "x" * 5000]})
    body = assert_refusal(resp, 413, "body_too_large")
    assert "4096" in body["detail"]
    assert fake.submitted == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the unread request body generator
async def test_body_over_the_limit_is_413_without_content_length(fake):
    chunks_read = []

    async def chunks():
        for i in range(100):
            chunks_read.append(i)
            yield b"x" * 1024

    async with client_for(make_app(fake)) as http:
        resp = await http.post("/v1/jobs", content=chunks())
    assert_refusal(resp, 413, "body_too_large")


async def test_unknown_route_404_and_wrong_method_405(http):
    assert_refusal(await http.get("/v2/whatever"), 404, "not_found")
    assert_refusal(await http.get("/v1/jobs/a/b/c"), 404, "not_found")
    body = assert_refusal(await http.delete("/v1/jobs"), 405, "method_not_allowed")
    assert "GET, POST" in body["detail"]
    assert_refusal(await http.get("/v1/jobs/x/cancel"), 405, "method_not_allowed")


async def test_runner_refusals_keep_their_code_status_and_fields(http, fake):
    fake.refusal = Refusal(code="runner_full", detail="queue is full (64)")
    assert_refusal(await http.post("/v1/jobs", json={"command": ["x"]}), 503, "runner_full")
    fake.refusal = Refusal(code="runner_disk_full", detail="below floor", free_bytes=5, floor_bytes=10)
    body = assert_refusal(await http.post("/v1/jobs", json={"command": ["x"]}), 503, "runner_disk_full")
    assert body["free_bytes"] == 5 and body["floor_bytes"] == 10
    fake.refusal = Refusal(code="workspace_setup_failed", detail="clone failed")
    assert_refusal(await http.post("/v1/jobs", json={"command": ["x"]}), 422, "workspace_setup_failed")


async def test_unexpected_exception_is_500_and_the_app_keeps_serving(http, fake, caplog):
    fake.explode = True
    with caplog.at_level(logging.ERROR, logger="motor.api"):
        body = assert_refusal(await http.get("/v1/health"), 500, "internal_error")
    assert "kaboom" in body["detail"]
    assert any(r.exc_info for r in caplog.records)
    fake.explode = False
    assert (await http.get("/v1/health")).status_code == 200


async def test_token_is_required_on_tcp_requests(fake):
    app = make_app(fake, token="s3cret")
    async with client_for(app, tcp=True) as http:
        assert_refusal(await http.get("/v1/health"), 401, "unauthorized")
        assert_refusal(await http.get("/v1/health", headers={"authorization": "Bearer nope"}),
                       401, "unauthorized")
        assert_refusal(await http.get("/nope", headers={"authorization": "Basic s3cret"}),
                       401, "unauthorized")
        ok = await http.get("/v1/health", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


async def test_token_is_read_from_the_configs_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    fake = FakeRunner(RunnerConfig(state_dir=str(tmp_path), token_file=str(token_file)))
    async with client_for(make_app(fake), tcp=True) as http:
        assert (await http.get("/v1/health")).status_code == 401
        ok = await http.get("/v1/health", headers={"authorization": "Bearer from-file"})
        assert ok.status_code == 200


async def test_bad_query_parameters(http):
    job_id = (await http.post("/v1/jobs", json={"command": ["true"]})).json()["job_id"]
    assert_refusal(await http.get(f"/v1/jobs/{job_id}/events?from_seq=x"), 400, "bad_request")
    assert_refusal(await http.get(f"/v1/jobs/{job_id}/events?from_seq=-1"), 400, "bad_request")
    too_big = await http.get(f"/v1/jobs/{job_id}/events?from_seq={2**63}")
    assert_refusal(too_big, 400, "bad_request")
    assert too_big.json()["detail"] == f"query parameter from_seq must be at most {2**63 - 1}"


async def test_a_runner_part_that_does_not_answer_in_time_is_503_runner_busy(http, fake,
                                                                             monkeypatch):
    """An actor call past its timeout (the dispatcher waiting on a locked job database, say)
    is 503 `runner_busy`, not a 500 with a traceback; the server answers the next request."""
    import actors

    async def status(full: bool = False):
        raise actors.CallTimeout("dispatcher", 30.0)

    monkeypatch.setattr(fake, "status", status)
    resp = await http.get("/v1/status")
    assert_refusal(resp, 503, "runner_busy")
    assert "call to actor 'dispatcher' timed out after 30.0s" in resp.json()["detail"]
    monkeypatch.undo()
    assert (await http.get("/v1/status")).status_code == 200


async def test_events_refusals_get_their_status(http, fake):
    assert_refusal(await http.get("/v1/jobs/nope/events"), 404, "not_found")
    fake.expired.add("old")
    assert_refusal(await http.get("/v1/jobs/old/events?from_seq=3"), 410, "history_expired")


async def test_bundle_upload_to_a_runner_without_a_bundle_store_is_not_found(http):
    # the fake runner has no put_bundle (the real one does: tests/disk, tests/e2e)
    resp = await http.put("/v1/bundles/" + "0" * 64, content=b"tar")
    assert_refusal(resp, 404, "not_found")
    assert "not supported by this runner" in resp.json()["detail"]


async def test_deeply_nested_json_is_a_bad_request_not_a_500(http, fake):
    fake.config.max_body_bytes = 1024 * 1024
    depth = 100_000
    for body in (b'{"command": ["true"], "extra": ' + b"[" * depth + b"]" * depth + b"}",
                 b'{"command": ' + b"[" * depth + b"]" * depth + b"}",
                 b'{"env": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"):
        app = make_app(fake)
        async with client_for(app) as client:
            assert_refusal(await client.post("/v1/jobs", content=body), 400, "bad_request")
    assert fake.submitted == []
    assert (await http.post("/v1/jobs", json={"command": ["true"]})).status_code == 202


async def test_tcp_without_a_token_serves_only_the_read_only_dashboard(fake):
    app = make_app(fake)  # no token: what `--listen 127.0.0.1:P` without --token-file serves
    async with client_for(app, tcp=True) as tcp:
        for path in ("/", "/metrics", "/v1/health", "/v1/status", "/v1/status/"):
            assert (await tcp.get(path)).status_code == 200, path
        refused = [("POST", "/v1/jobs"), ("GET", "/v1/jobs"), ("GET", "/v1/jobs?all=1"),
                   ("GET", "/v1/jobs/x"), ("GET", "/v1/jobs/x/events"),
                   ("POST", "/v1/jobs/x/cancel"), ("POST", "/v1/jobs/x/withdraw"),
                   ("GET", "/v1/workspaces"), ("PUT", "/v1/bundles/" + "0" * 64),
                   ("POST", "/"), ("POST", "/metrics"), ("GET", "/nope")]
        for method, path in refused:
            resp = await tcp.request(method, path, json={"command": ["id"]})
            body = assert_refusal(resp, 401, "unauthorized")
            assert "--token-file" in body["detail"], (method, path)
    assert fake.submitted == []
    async with client_for(app) as unix:  # the Unix socket is not limited
        assert (await unix.post("/v1/jobs", json={"command": ["id"]})).status_code == 202
        assert (await unix.get("/v1/jobs")).status_code == 200
