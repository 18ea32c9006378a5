"""The app served for real by hypercorn (serve_api) on a Unix socket: streams, socket handling,
and the synchronous and asynchronous clients."""

from __future__ import annotations

import json
import os
import socket
import stat

import httpx
import pytest
import trio
from fake_runner import FakeRunner, queue_then_withdraw, wait_for_cancel

from motor.api import SocketInUse, make_app, serve_api, server
from motor.client import AsyncClient, Client, RunnerUnavailable
from motor.config import RunnerConfig
from motor.records import Accepted, JobRecord, JobRequest, Output, RefusedError, Terminal


def raw_client(config: RunnerConfig) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(config.socket_path)),
                             base_url="http://motor", timeout=10)


async def read_ndjson(resp: httpx.Response) -> list[dict]:
    return [json.loads(line) async for line in resp.aiter_lines() if line]


async def test_socket_is_0600_and_answers(live, config):
    mode = stat.S_IMODE(os.stat(config.socket_path).st_mode)
    assert mode == 0o600
    async with raw_client(config) as http:
        resp = await http.get("/v1/health")
    assert resp.status_code == 200
    assert resp.headers["motor-capabilities"] == "gate_jobs,follow,withdraw"


async def test_socket_group_makes_it_0660(config, nursery):
    config = RunnerConfig(state_dir=config.state_dir, socket=config.socket, socket_group=str(os.getgid()))
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    st = os.stat(config.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()


async def test_submit_follow_streams_ndjson(live, config):
    async with raw_client(config) as http:
        async with http.stream("POST", "/v1/jobs?follow=1", json={"command": ["make"]}) as resp:
            assert resp.status_code == 202
            assert resp.headers["content-type"] == "application/x-ndjson"
            events = await read_ndjson(resp)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "terminal"
    assert "output" in kinds and "started" in kinds
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert events[-1]["record"]["state"] == "succeeded"
    assert live.submitted[0][1] is True  # follow reached the runner


async def test_submit_follow_refused_is_a_plain_refusal(live, config):
    async with raw_client(config) as http:
        resp = await http.post("/v1/jobs?follow=1", json={"command": ["make"], "workspace": ".."})
    assert resp.status_code == 400 and resp.json()["code"] == "bad_request"


async def test_events_replay_from_seq_and_history_expired(live, config):
    async with raw_client(config) as http:
        job_id = (await http.post("/v1/jobs", json={"command": ["x"]})).json()["job_id"]
        await trio.sleep(0.05)
        async with http.stream("GET", f"/v1/jobs/{job_id}/events", params={"from_seq": 3}) as resp:
            assert resp.status_code == 200
            events = await read_ndjson(resp)
        assert events[0]["seq"] == 3 and events[-1]["event"] == "terminal"
        live.expired.add(job_id)
        resp = await http.get(f"/v1/jobs/{job_id}/events")
        assert resp.status_code == 410 and resp.json()["code"] == "history_expired"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_events_are_flushed_as_they_happen(live, config):
    live.script = wait_for_cancel
    async with raw_client(config) as http:
        job_id = (await http.post("/v1/jobs", json={"command": ["x"]})).json()["job_id"]
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            lines = resp.aiter_lines()
            seen = []
            with trio.fail_after(5):
                async for line in lines:
                    seen.append(json.loads(line))
                    if seen[-1]["event"] == "output":
                        break  # arrived while the job is still running
            await http.post(f"/v1/jobs/{job_id}/cancel")
            with trio.fail_after(5):
                async for line in lines:
                    seen.append(json.loads(line))
    assert seen[-1]["event"] == "terminal" and seen[-1]["record"]["state"] == "cancelled"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_client_disconnect_ends_the_stream_and_server_keeps_serving(live, config):
    live.script = wait_for_cancel
    async with raw_client(config) as http:
        job_id = (await http.post("/v1/jobs", json={"command": ["x"]})).json()["job_id"]
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
            async for line in resp.aiter_lines():
                break
    async with raw_client(config) as http:
        assert (await http.get("/v1/health")).status_code == 200


async def test_stale_socket_file_is_replaced(config, nursery):
    path = config.socket_path
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file remains; nobody listens
    assert path.exists()
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    async with raw_client(config) as http:
        assert (await http.get("/v1/health")).status_code == 200


async def test_live_socket_is_refused(live, config, nursery):
    with pytest.raises(SocketInUse, match="another runner is listening on"):
        await serve_api(make_app(FakeRunner(config)), config)
    async with raw_client(config) as http:  # the first one still serves
        assert (await http.get("/v1/health")).status_code == 200


async def test_non_socket_file_is_refused(config):
    config.socket_path.write_text("not a socket")
    with pytest.raises(SocketInUse, match="not a socket"):
        await serve_api(make_app(FakeRunner(config)), config)


async def test_a_socket_file_removed_under_the_runner_is_bound_again(config, nursery, monkeypatch):
    """Before stop 49 a runner whose socket file was removed (a clean-up of old files) ran
    on, alive to its supervisor, and no client reached it again. Now it binds the path
    again within SOCKET_CHECK_S, with the socket's mode, and serves there; a file put in
    its place is left alone."""
    monkeypatch.setattr(server, "SOCKET_CHECK_S", 0.05)
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    path = config.socket_path
    os.unlink(path)
    await wait_until(path.exists)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    async with raw_client(config) as http:
        assert (await http.get("/v1/health")).status_code == 200
    os.unlink(path)
    path.write_text("someone else's")
    await trio.sleep(0.2)  # four checks
    assert path.read_text() == "someone else's"


def listening_when_linked(monkeypatch) -> list[str]:
    """Every link `bind_listening` makes, checked as it is made: the socket it puts in place
    already takes connections, with its final mode. The names linked."""
    linked, link = [], os.link

    def checked(src, dst, *, src_dir_fd, dst_dir_fd):
        address = f"/proc/self/fd/{src_dir_fd}/{src}"
        assert stat.S_IMODE(os.stat(address).st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(address)  # before: refused (hypercorn bound, then listened)
        link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        linked.append(dst)

    monkeypatch.setattr(server.os, "link", checked)
    return linked


async def test_the_socket_file_appears_only_once_its_socket_listens(config, nursery, monkeypatch):
    """Before stop 76 hypercorn bound the socket file and listened a moment after: a client
    that found the file in between (`motor serve` started by a script, then a submit) was
    refused, and told no runner answered. The file is now linked in once the socket listens,
    at its start and when it is bound again."""
    monkeypatch.setattr(server, "SOCKET_CHECK_S", 0.05)
    linked = listening_when_linked(monkeypatch)
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    os.unlink(config.socket_path)
    await wait_until(config.socket_path.exists)
    assert linked == [config.socket_path.name] * 2
    assert sorted(os.listdir(config.socket_path.parent)) == [config.socket_path.name]


def test_bind_listening_where_the_hidden_name_is_too_long_for_sun_path(short_dir):
    """A socket path that fits sun_path, in a directory that leaves no room for the longer
    hidden name bound first: that name is bound through /proc/self/fd."""
    from motor.config import MAX_SOCKET_PATH

    deep = short_dir / ("d" * (MAX_SOCKET_PATH - len(str(short_dir)) - len("/m.sock") - 1))
    deep.mkdir()
    path = deep / "m.sock"
    assert len(str(path)) == MAX_SOCKET_PATH
    sock, inode = server.bind_listening(path, 8, None)
    with sock, socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))
        assert os.stat(path).st_ino == inode
    assert os.listdir(deep) == [path.name]


def test_bind_listening_makes_the_file_private_without_the_processs_umask(short_dir,
                                                                         monkeypatch):
    """Under a umask of 0 the file is private from its bind on (the socket's own mode, set
    before the bind), and the process's umask, which the runner's other threads create
    files under, is never changed."""
    umask = os.umask
    previous = umask(0)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "chmod", lambda *a, **kw: None)  # the bind's mode alone
            patch.setattr(os, "umask", lambda *a: pytest.fail("the umask was changed"))
            sock, _ = server.bind_listening(short_dir / "m.sock", 8, None)
    finally:
        umask(previous)
    with sock:
        assert stat.S_IMODE(os.stat(short_dir / "m.sock").st_mode) == 0o600


def test_bind_listening_keeps_a_file_put_at_the_path_meanwhile(short_dir):
    """Another runner's socket, bound between the claim and the link, stays; this runner
    is told the path is in use and leaves nothing behind."""
    path = short_dir / "m.sock"
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(path))
        other.listen(1)
        with pytest.raises(SocketInUse, match="appeared while this runner bound it"):
            server.bind_listening(path, 8, None)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # still the other's
    assert os.listdir(short_dir) == ["m.sock"]


async def wait_until(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_socket_removed_on_shutdown(config):
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_api(
            make_app(FakeRunner(config)), config, shutdown_trigger=done.wait, task_status=task_status))
        assert config.socket_path.exists()
        done.set()
    assert not config.socket_path.exists()


async def test_tcp_listener_requires_the_token(short_dir, nursery):
    token_file = short_dir / "token"
    token_file.write_text("tok\n")
    config = RunnerConfig(state_dir=str(short_dir), socket=str(short_dir / "m.sock"),
                          listen="127.0.0.1:0", token_file=str(token_file))
    fake = FakeRunner(config)
    binds = await nursery.start(serve_api, make_app(fake), config)
    url = next(b for b in binds if "unix:" not in b)
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.get("/v1/health")).status_code == 401
        assert (await http.get("/v1/health", headers={"authorization": "Bearer tok"})).status_code == 200
    async with raw_client(config) as http:  # the Unix socket needs no token
        assert (await http.get("/v1/health")).status_code == 200
    client = AsyncClient(url=url, token="tok")
    async with client:
        assert (await client.health())["isolation"] == "none"


# --- clients --------------------------------------------------------------------------------


async def test_async_client(live, config):
    async with AsyncClient(config.socket_path) as client:
        record = await client.submit(JobRequest(command=["make"]))
        assert isinstance(record, JobRecord)
        assert client.runner_capabilities == ["gate_jobs", "follow", "withdraw"]
        assert live.submitted[0][0].capabilities == ["gate_jobs", "follow", "withdraw"]
        assert (await client.get(record.job_id)).job_id == record.job_id
        assert [r.job_id for r in await client.jobs(all=True)] == [record.job_id]
        async with await client.events(record.job_id) as stream:
            events = [e async for e in stream]
        assert isinstance(events[0], Accepted) and isinstance(events[-1], Terminal)
        async with await client.submit(JobRequest(command=["make"]), follow=True) as stream:
            followed = [e async for e in stream]
        assert isinstance(followed[-1], Terminal)
        assert await client.withdraw(record.job_id) == "withdrawn"
        assert (await client.status())["queued"] == []
        assert (await client.workspaces())[0]["name"] == "default"
        assert "motor_jobs_total" in await client.metrics()
        with pytest.raises(RefusedError) as info:
            await client.get("nope")
        assert info.value.refusal.code == "not_found"
        with pytest.raises(RefusedError) as info:
            await client.submit(JobRequest(command=["x"], workspace="a/b"))
        assert info.value.refusal.code == "bad_request"


async def test_sync_client_in_a_thread(live, config):
    def use_client():
        with Client(config.socket_path) as client:
            record = client.submit(JobRequest(command=["make"]))
            with client.submit(JobRequest(command=["make"]), follow=True) as stream:
                kinds = [type(e).__name__ for e in stream]
            with client.events(record.job_id, 4) as stream:
                replay = list(stream)
            outputs = [e for e in replay if isinstance(e, Output)]
            try:
                client.events("missing")
            except RefusedError as exc:
                missing = exc.refusal.code
            return record, kinds, replay, outputs, missing, client.health()

    record, kinds, replay, outputs, missing, health = await trio.to_thread.run_sync(use_client)
    assert kinds[0] == "Accepted" and kinds[-1] == "Terminal"
    assert replay[0].seq == 4
    assert outputs and missing == "not_found"
    assert health["isolation"] == "none"


async def test_withdraw_during_queue(live, config):
    live.script = queue_then_withdraw
    async with AsyncClient(config.socket_path) as client:
        async with await client.submit(JobRequest(command=["x"]), follow=True) as stream:
            async for event in stream:
                if event.__class__.__name__ == "Queued":
                    assert await client.withdraw(live.submitted and list(live.jobs_by_id)[0]) == "withdrawn"
                if isinstance(event, Terminal):
                    assert event.record["reason"] == "queue_wait_exceeded"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # httpcore leaks the socket of a refused connect
def test_runner_unavailable_without_socket(tmp_path):
    with Client(tmp_path / "none.sock") as client:
        with pytest.raises(RunnerUnavailable):
            client.health()
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    with Client(stale) as client:
        with pytest.raises(RunnerUnavailable):
            client.status()


async def test_async_client_runner_unavailable(tmp_path):
    async with AsyncClient(tmp_path / "none.sock") as client:
        with pytest.raises(RunnerUnavailable):
            await client.health()


async def test_oversized_body_over_the_socket_is_413(live, config):
    async with raw_client(config) as http:
        resp = await http.post("/v1/jobs", content=b'{"command": ["' + b"x" * 100_000 + b'"]}')
        assert resp.status_code == 413 and resp.json()["code"] == "body_too_large"
    async with raw_client(config) as http:
        assert (await http.get("/v1/health")).status_code == 200
    assert live.submitted == []


# --- hostile clients: stalled bodies, absurd lengths, too many connections ------------------


async def raw_exchange(config: RunnerConfig, data: bytes, *, timeout: float = 30) -> tuple[bytes, bool]:
    """Send `data` on a fresh socket connection, then read until the runner closes it.
    Returns (everything read, closed by the runner within `timeout`)."""
    sock = trio.socket.socket(socket.AF_UNIX)
    await sock.connect(str(config.socket_path))
    got = b""
    with sock:
        await sock.send(data)
        with trio.move_on_after(timeout):
            while chunk := await sock.recv(65536):
                got += chunk
            return got, True
    return got, False


def answer_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture
def short_deadline(config) -> RunnerConfig:
    config.body_timeout_s = 0.5
    config.max_body_bytes = 1024 * 1024
    return config


async def test_a_stalled_body_is_answered_408_and_closed(short_deadline, nursery):
    config = short_deadline
    fake = FakeRunner(config, nursery=nursery)
    await nursery.start(serve_api, make_app(fake), config)
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: m\r\nContent-Length: 100000\r\n\r\n"
    with trio.fail_after(20):
        raw, closed = await raw_exchange(config, head + b'{"command": ["' + b"x" * 5000)
    assert closed, "the runner kept a stalled body's connection open"
    status, body = answer_of(raw)
    assert status == 408 and body["code"] == "request_timeout", raw
    assert "5014 of 100000" in body["detail"], body
    async with raw_client(config) as http:  # and it keeps serving
        assert (await http.post("/v1/jobs", json={"command": ["true"]})).status_code == 202
    assert len(fake.submitted) == 1


async def test_a_content_length_of_2_to_the_64_gets_an_answer(live, config):
    for request in (b"POST /v1/jobs HTTP/1.1\r\nHost: m\r\nContent-Length: %d\r\n\r\n{" % 2**64,
                    b"PUT /v1/bundles/%s HTTP/1.1\r\nHost: m\r\nContent-Length: %d\r\n\r\n{"
                    % (b"0" * 64, 2**64)):
        with trio.fail_after(20):
            raw, closed = await raw_exchange(config, request, timeout=5)
        assert raw.startswith(b"HTTP/1.1 413"), raw
        assert answer_of(raw)[1]["code"] == "body_too_large"


async def test_connections_above_the_cap_are_answered_503(config, nursery):
    config.max_connections = 20
    await nursery.start(serve_api, make_app(FakeRunner(config)), config)
    held = []
    try:
        for _ in range(20):
            sock = trio.socket.socket(socket.AF_UNIX)
            await sock.connect(str(config.socket_path))
            held.append(sock)
        with trio.fail_after(20):
            raw, closed = await raw_exchange(config, b"GET /v1/health HTTP/1.1\r\nHost: m\r\n\r\n")
        status, body = answer_of(raw)
        assert (status, body["code"]) == (503, "too_many_connections") and closed, raw
        assert "20" in body["detail"]
    finally:
        for sock in held:
            sock.close()
    async def served() -> bool:
        async with raw_client(config) as http:
            return (await http.get("/v1/health")).status_code == 200
    with trio.fail_after(20):  # the slots come back as the runner sees the closes
        while True:
            try:
                if await served():
                    break
            except httpx.HTTPError:
                pass
            await trio.sleep(0.05)


async def test_a_follower_that_goes_away_mid_replay_stops_the_replay(live, config, monkeypatch):
    """A client that closes its event stream while the runner replays a job's stored output
    (Ctrl-C on `motor attach` of a chatty job): the replay stops there. Before stop 56 the
    connection's writes failed quietly and nothing in the replay loop let the disconnect
    through, so the runner read and encoded the rest of the job's output for nobody, its
    event loop busy meanwhile (100 such followers of a 60 MB job: 12 s of CPU, and the
    RSS grew by 130 MiB)."""
    import trio.socket as tsocket

    pulled, done = [0], trio.Event()

    async def events(job_id: str, from_seq: int = 0):
        try:
            for seq in range(20_000):
                pulled[0] += 1
                yield Output(seq=seq, stream="stdout", data="x" * 4096)
        finally:
            done.set()

    monkeypatch.setattr(live, "events", events)
    sock = tsocket.socket(socket.AF_UNIX)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(str(config.socket_path))
    await sock.send(b"GET /v1/jobs/j/events HTTP/1.1\r\nhost: m\r\n\r\n")
    assert (await sock.recv(4096)).startswith(b"HTTP/1.1 200")
    sock.close()
    with trio.fail_after(30):
        await done.wait()
    assert pulled[0] < 20_000, pulled


@pytest.mark.parametrize("seconds", [1.5, 0, -1, float("inf"), float("nan")])
def test_the_head_timeout_is_the_configs_and_at_least_two_seconds(seconds):
    """`--head-timeout` is hypercorn's keep-alive timeout (5 s by default). A client reuses
    a kept connection within 1 s, so less than 2 s is refused."""
    from motor.config import HEAD_TIMEOUT_S, ConfigError, build_config

    assert server.hypercorn_config(RunnerConfig()).keep_alive_timeout == HEAD_TIMEOUT_S == 5
    config = build_config({}, {"head_timeout_s": 7.5})
    assert server.hypercorn_config(config).keep_alive_timeout == 7.5
    with pytest.raises(ConfigError, match="--head-timeout must be at least 2 seconds"):
        build_config({"head_timeout_s": seconds}, {})
