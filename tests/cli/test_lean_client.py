"""The lean client path: `motor run/submit/status/...` load neither the runner nor its API
server (hypercorn), trio, httpx or the scheduling core, nor msgspec, motor.records,
motor.config, typing, pathlib or urllib (milliseconds each: docs/cli.md, "Start-up cost");
`import motor` loads nothing of the embedding API until a name is used; the client's own
HTTP/1.1 transport against a real `motor serve` and against a byte-exact server (chunked
bodies, early close, garbage); the constants the client shares with the runner (motor/wire.py).

Structural, not timed: which modules a command imports is read from `python -X importtime`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from motor.client import Client, RunnerUnavailable
from motor.records import JobRequest, RefusedError, Terminal
from socket_helpers import read_until, serve_each

ROOT = Path(__file__).resolve().parents[2]


def motor_env(extra: dict | None = None) -> dict:
    """The environment `Serve.cli` gives a command (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MOTOR_SOCKET", "MOTOR_STATE_DIR")}
    return env | (extra or {})

#: never on a client command's path (top-level packages and motor subpackages)
FORBIDDEN = ("hypercorn", "httpx", "httpcore", "trio", "h11", "h2", "anyio",
             "motor.runner", "motor.api", "motor.scheduling", "motor.execution", "motor.disk",
             "motor.store", "motor.isolation", "motor.actors", "prometheus_client", "psutil")


def imported_modules(*argv: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, set[str]]:
    result = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                            timeout=60, env=motor_env(env_extra), cwd=ROOT)
    modules = set()
    for line in result.stderr.decode(errors="replace").splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                modules.add(name)
    assert "motor.cli" in modules or argv[:2] != ("-m", "motor"), result.stderr.decode()[-2000:]
    return result, modules


#: not on the way to a job either (`motor status` text loads rich, which may load typing)
LEAN_FORBIDDEN = FORBIDDEN + ("msgspec", "typing_extensions", "motor.records", "motor.config",
                              "motor.cli.serve", "motor.cli.tasks", "motor.cli.render", "rich",
                              "typing", "pathlib", "urllib", "uuid", "decimal", "inspect",
                              "threading")  # threading: the queue-wait timer of a waiting job


def forbidden_in(modules: set[str], forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


_site_modules: set[str] = set()


def lean_forbidden_in(modules: set[str]) -> list[str]:
    """LEAN_FORBIDDEN modules that motor loaded: what the interpreter's start-up loads
    (site, and an editable install's import hook, which brings pathlib and urllib) is not
    motor's doing."""
    if not _site_modules:
        result = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True,
                                timeout=60, env=motor_env(), cwd=ROOT)
        _site_modules.update(line.rsplit("|", 1)[1].strip() for line in result.stderr.decode().splitlines()
                             if line.startswith("import time:") and "|" in line)
    return forbidden_in(modules - _site_modules, LEAN_FORBIDDEN)


@pytest.mark.parametrize("command", ["run", "submit", "status", "attach", "cancel", "withdraw",
                                     "jobs", "health", "workspaces", "task"])
def test_client_command_help_imports_no_runner_server_or_trio(command):
    result, modules = imported_modules("-m", "motor", command, "--help")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert forbidden_in(modules) == []
    assert "rich" not in modules  # the tables' library is loaded only to draw a table
    if command != "task":  # motor.cli.tasks is not this module's (it imports msgspec)
        assert lean_forbidden_in(modules) == []


C_LOCALE = {"LANGUAGE": "", "LC_ALL": "", "LC_MESSAGES": "", "LANG": "C.UTF-8"}


@pytest.mark.parametrize("environ, untranslated", [
    ({}, True), ({"LANG": "C"}, True), ({"LANG": "C.UTF-8"}, True), ({"LANG": "POSIX"}, True),
    ({"LC_ALL": "", "LANG": "C.utf8"}, True), ({"LANGUAGE": "C:de"}, True),
    ({"LANG": "de_DE.UTF-8"}, False), ({"LC_MESSAGES": "fr_FR", "LANG": "C"}, False),
    ({"LANGUAGE": "de:C", "LANG": "C.UTF-8"}, False), ({"LC_ALL": "C", "LANG": "de_DE"}, True),
])
def test_gettext_is_skipped_exactly_where_it_would_translate_nothing(environ, untranslated):
    from motor.cli import _messages_untranslated

    assert _messages_untranslated(environ) is untranslated


def test_a_command_in_the_c_locale_never_imports_locale_and_elsewhere_asks_gettext():
    """In the C locale argparse gets its messages as they are: gettext's look-up, which
    imports `locale` (2 ms of a start), is not made; in another locale it still is."""
    result, modules = imported_modules("-m", "motor", "run", "--help", env_extra=C_LOCALE)
    assert result.returncode == 0 and b"usage: motor run" in result.stdout, result.stderr[-2000:]
    assert "locale" not in modules - _site_modules_of(C_LOCALE)

    german = C_LOCALE | {"LANG": "de_DE.UTF-8"}
    result, modules = imported_modules("-m", "motor", "run", "--help", env_extra=german)
    assert result.returncode == 0 and b"motor run" in result.stdout, result.stderr[-2000:]
    assert "locale" in modules


def _site_modules_of(extra: dict) -> set[str]:
    """What `python -c pass` itself imports in that environment."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True,
                            timeout=60, env=motor_env(extra), cwd=ROOT)
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.decode().splitlines()
            if line.startswith("import time:") and "|" in line}


def test_run_submit_status_against_a_real_runner_import_no_runner_server_or_trio(serve):
    sock = str(serve.socket)
    result, modules = imported_modules("-m", "motor", "run", "--socket", sock, "--", "sh", "-c", "echo lean")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout == b"lean\n"
    assert lean_forbidden_in(modules) == []

    result, modules = imported_modules("-m", "motor", "run", "--socket", sock, "--json", "--", "true")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert [json.loads(line)["event"] for line in result.stdout.splitlines()][-1] == "terminal"
    assert lean_forbidden_in(modules) == []

    result, modules = imported_modules("-m", "motor", "submit", "--socket", sock, "--", "true")
    assert result.returncode == 0 and result.stdout.strip()
    assert lean_forbidden_in(modules) == []
    job_id = result.stdout.decode().strip()

    result, modules = imported_modules("-m", "motor", "attach", "--socket", sock, job_id)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert lean_forbidden_in(modules) == []

    for command in (("cancel", job_id), ("withdraw", job_id), ("health",), ("jobs",)):
        result, modules = imported_modules("-m", "motor", command[0], "--socket", sock, "--json", *command[1:])
        assert result.returncode in (0, 1), result.stderr.decode()[-2000:]  # withdraw: already_ended
        assert lean_forbidden_in(modules) == [], command

    result, modules = imported_modules("-m", "motor", "status", "--socket", sock, "--json")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert forbidden_in(modules) == [] and "rich" not in modules
    assert lean_forbidden_in(modules) == []

    # a refusal loads the typed Refusal (msgspec) only then, and still prints one line
    result, modules = imported_modules("-m", "motor", "run", "--socket", sock, "--workspace", "a/b", "--", "true")
    assert result.returncode == 65
    assert result.stderr.decode().splitlines()[-1].startswith("motor: refused: bad_request: workspace 'a/b'")
    assert forbidden_in(modules) == []

    result, modules = imported_modules("-m", "motor", "status", "--socket", sock)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert forbidden_in(modules) == []


def test_import_motor_is_lazy_and_the_embedding_names_still_resolve():
    code = (
        "import sys, motor\n"
        "heavy = [m for m in ('motor.runner', 'trio', 'hypercorn', 'motor.records', 'motor.config') if m in sys.modules]\n"
        "assert heavy == [], heavy\n"
        "assert motor.JobRequest.__module__ == 'motor.records' and 'motor.runner' not in sys.modules\n"
        "from motor import RunnerConfig, open_runner, Runner, StartupError, WallClock\n"
        "assert 'motor.runner' in sys.modules and callable(open_runner)\n"
        "assert set(motor.__all__) <= set(dir(motor))\n"
        "try:\n"
        "    motor.no_such_name\n"
        "except AttributeError as exc:\n"
        "    assert 'no_such_name' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                            env=motor_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b"ok\n"


# --- the transport, byte-exact ----------------------------------------------------------------


class OneShotServer:
    """A Unix socket that answers each connection with the next canned byte string (then
    closes, saying so: `Connection: close`), and keeps what each request sent."""

    def __init__(self, path, answers: list[bytes], delay: float = 0.0):
        self.path = str(path)
        self.answers = list(answers)
        self.delay = delay  # seconds to hold each answer back (a runner busy admitting)
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for answer in self.answers:
            conn, _ = self.sock.accept()
            with conn:
                data, _ = read_until(conn, b"\r\n\r\n")
                head, _, body = data.partition(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        want = int(line.split(b":")[1])
                        while len(body) < want:
                            body += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + body)
                time.sleep(self.delay)
                if answer.startswith(b"HTTP/1.1 ") and b"\r\n" in answer:  # it closes: it says so
                    status, _, rest = answer.partition(b"\r\n")
                    answer = status + b"\r\nConnection: close\r\n" + rest
                try:
                    conn.sendall(answer)
                except OSError:  # the client gave up waiting
                    pass

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def one_shot(tmp_path):
    servers = []

    def make(*answers: bytes, delay: float = 0.0) -> OneShotServer:
        servers.append(OneShotServer(tmp_path / f"s{len(servers)}.sock", list(answers), delay))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_chunked_and_length_bodies_and_a_refusal(one_shot):
    refusal = b'{"refused": true, "code": "not_found", "detail": "no job"}'
    server = one_shot(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Motor-Capabilities: follow,withdraw\r\n\r\n"
        b"5;ext=1\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\nTrailer: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"b\": [2]}",
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(refusal), refusal),
    )
    with Client(server.path, token="t0k") as client:
        assert client.call("GET", "/v1/health") == {"a": 1}
        assert client.runner_capabilities == ["follow", "withdraw"]
        assert client.call("POST", "/v1/jobs", json={"x": "é"}) == {"b": [2]}
        with pytest.raises(RefusedError) as info:
            client.get("j/1")
    assert info.value.refusal.code == "not_found" and info.value.refusal.detail == "no job"
    first, second, third = server.requests
    assert first.startswith(b"GET /v1/health HTTP/1.1\r\n") and b"authorization: Bearer t0k" in first
    assert second.startswith(b"POST /v1/jobs HTTP/1.1\r\n")
    assert second.endswith(b'\r\n\r\n{"x":"\xc3\xa9"}') and b"content-length: 10" in second.lower()
    assert third.startswith(b"GET /v1/jobs/j%2F1 HTTP/1.1\r\n")


def test_an_event_stream_cut_short_is_runner_unavailable_and_garbage_too(one_shot):
    line = b'{"event":"accepted","seq":0,"job_id":"j1","claim":1}\n'
    server = one_shot(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(line) + line + b"\r\n" + b"40\r\nshort",  # the runner died mid-chunk
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"",
    )
    with Client(server.path) as client:
        stream = client.submit(JobRequest(command=["true"]), follow=True)
        first = next(stream)
        assert first.job_id == "j1"
        with pytest.raises(RunnerUnavailable, match="lost the connection"):
            list(stream)
        with pytest.raises(RunnerUnavailable, match="not an HTTP/1.1 answer"):
            client.health()
        with pytest.raises(RunnerUnavailable, match="without an answer"):
            client.status()


class KeepAliveServer:
    """A Unix socket that answers every request with `{"n": N}` (N: the request's number)
    and keeps each connection open until the client closes it, or until the test asks
    (`close_open`); counts connections and keeps the requests' first lines."""

    def __init__(self, path):
        self.path = str(path)
        self.connections = 0
        self.lines: list[bytes] = []
        self.open: list[socket.socket] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        self.sock.listen(4)
        serve_each(self.sock, self._serve)

    def _serve(self, conn: socket.socket) -> None:
        self.connections += 1
        self.open.append(conn)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                want = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        want = int(line.split(b":")[1])
                while len(buf) < want:
                    buf += conn.recv(65536)
                buf = buf[want:]
                self.lines.append(head.split(b"\r\n")[0])
                if b"follow=1" in self.lines[-1]:
                    conn.sendall(self._stream(len(self.lines)))
                    continue
                body = b'{"n": %d}' % len(self.lines)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            return

    #: what a follow's chunked NDJSON body has after its terminal event: its end ("end",
    #: as the runner sends it), one more event and its end ("more"), or nothing ("hold")
    after_terminal = "end"

    def _stream(self, n: int) -> bytes:
        def chunk(data: bytes) -> bytes:
            return b"%x\r\n%s\r\n" % (len(data), data)

        out = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n"
               + chunk(b'{"event": "accepted", "n": %d}\n' % n)
               + chunk(b'{"event": "terminal", "n": %d}\n' % n))
        if self.after_terminal == "more":
            out += chunk(b'{"event": "output", "n": %d}\n' % n)
        if self.after_terminal != "hold":
            out += b"0\r\n\r\n"
        return out

    def close_open(self) -> None:
        for conn in self.open:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # (a close alone would wait for the recv)
            except OSError:
                pass
            conn.close()
        self.open = []

    def close(self) -> None:
        self.close_open()
        self.sock.close()


def test_requests_one_after_another_share_one_kept_connection(tmp_path, monkeypatch):
    """Issue 14: a response read to its end leaves its connection to the next request (no
    `connection: close` sent); after the server closed the idle one, the next request
    goes over a new one and is answered; one idle for longer than `REUSE_S` is not
    taken."""
    from motor.client import _Wire

    server = KeepAliveServer(tmp_path / "k.sock")
    try:
        with Client(server.path) as client:
            assert [client.call("GET", "/v1/health")["n"] for _ in range(3)] == [1, 2, 3]
            assert client.call("POST", "/v1/jobs", json={"command": ["true"]}) == {"n": 4}
            assert server.connections == 1
            server.close_open()  # the runner let the idle connection go
            time.sleep(0.05)
            assert client.call("POST", "/v1/jobs", json={"command": ["true"]}) == {"n": 5}
            assert server.connections == 2
            monkeypatch.setattr(_Wire, "REUSE_S", 0.0)
            time.sleep(0.01)
            assert client.call("GET", "/v1/health") == {"n": 6}
            assert server.connections == 3
        assert not any(b"connection: close" in line.lower() for line in server.lines)
    finally:
        server.close()


def _follow_to_terminal(client: Client, raw: bool = True) -> list:
    """Follow a submit as `motor run` and bench/latency.py do: stop at the terminal event."""
    seen = []
    with client.submit({"command": ["true"]} if raw else JobRequest(command=["true"], weight_hint=1),
                       follow=True, raw=raw) as stream:
        for event in stream:
            seen.append(event)
            if (event.get("event") if raw else event.__struct_config__.tag) == "terminal":
                break
    return seen


def test_a_stream_left_at_its_terminal_event_leaves_its_connection_to_the_next_request(
        tmp_path, monkeypatch):
    """Issue 14: a follow left at its last event (terminal), the body's end not yet read,
    keeps its connection: the next request reads that end, then goes over it. Anything
    else after the terminal event, or no end within `REST_S`, and the next request goes
    over a new connection (and is answered); so does one after a stream left before its
    terminal event."""
    from motor.client import _Wire

    server = KeepAliveServer(tmp_path / "k.sock")
    try:
        with Client(server.path) as client:
            assert [e["n"] for e in _follow_to_terminal(client)] == [1, 1]
            assert [e["n"] for e in _follow_to_terminal(client)] == [2, 2]
            assert client.call("GET", "/v1/health") == {"n": 3}
            assert server.connections == 1

            server.after_terminal = "more"
            assert [e["n"] for e in _follow_to_terminal(client)] == [4, 4]
            assert client.call("GET", "/v1/health") == {"n": 5}
            assert server.connections == 2

            server.after_terminal = "hold"
            monkeypatch.setattr(_Wire, "REST_S", 0.05)
            assert [e["n"] for e in _follow_to_terminal(client)] == [6, 6]
            assert client.call("GET", "/v1/health") == {"n": 7}
            assert server.connections == 3

            server.after_terminal = "end"
            with client.submit({"command": ["true"]}, follow=True, raw=True) as stream:
                assert next(stream)["event"] == "accepted"  # left before its terminal event
            assert client.call("GET", "/v1/health") == {"n": 9}
            assert server.connections == 4
    finally:
        server.close()


def test_a_connection_the_runner_closes_is_not_kept(one_shot):
    """A response that says `Connection: close` (the one-shot server's) leaves nothing
    kept: each request connects anew and is answered."""
    server = one_shot(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
                      b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    with Client(server.path) as client:
        assert client.call("GET", "/v1/health") == {}
        assert client._wire._idle is None
        assert client.call("GET", "/v1/health") == {}
    assert len(server.requests) == 2


def test_a_client_submitting_to_a_real_runner_keeps_one_connection(serve, monkeypatch):
    """Through `motor serve` (hypercorn keeps an idle connection for 5 s): twenty submits
    and a status read one after another make one connection, and every job runs."""
    from motor.client import _Wire

    made = []
    connect = _Wire._connect
    monkeypatch.setattr(_Wire, "_connect", lambda self: made.append(1) or connect(self))
    with Client(serve.socket) as client:
        ids = [client.submit(JobRequest(command=["true"], weight_hint=1)).job_id for _ in range(20)]
        client.status()
        assert len(made) == 1
    for job_id in ids:
        assert serve.cli("attach", job_id).returncode == 0


def test_jobs_followed_one_after_another_through_a_real_runner_keep_one_connection(
        serve, monkeypatch):
    """Through `motor serve`: five submits followed to their terminal events (left there,
    as `motor run` leaves them), decoded and raw, then a status read, over one connection;
    every job succeeded."""
    from motor.client import _Wire

    made = []
    connect = _Wire._connect
    monkeypatch.setattr(_Wire, "_connect", lambda self: made.append(1) or connect(self))
    with Client(serve.socket) as client:
        ends = [_follow_to_terminal(client, raw=i % 2 == 0)[-1] for i in range(5)]
        client.status()
        assert len(made) == 1
    states = [e["record"]["state"] if isinstance(e, dict) else e.record["state"] for e in ends]
    assert states == ["succeeded"] * 5


def test_bundle_upload_and_follow_against_a_real_runner(serve, tmp_path):
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"hello from a bundle\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    bundle = tmp_path / "b.tar"
    bundle.write_bytes(buf.getvalue())
    digest = hashlib.sha256(buf.getvalue()).hexdigest()
    with Client(serve.socket) as client:
        assert client.put_bundle(digest, bundle)  # a path: sent with its length
        with pytest.raises(RefusedError) as info:  # a file object: chunked; a wrong digest
            client.put_bundle("0" * 64, io.BytesIO(buf.getvalue()))
        assert info.value.refusal.code == "bad_request"
        stream = client.submit(JobRequest(command=["cat", "hello.txt"], workspace="lean",
                                          bundle_sha256=digest), follow=True)
        events = list(stream)
    assert isinstance(events[-1], Terminal) and events[-1].record["state"] == "succeeded"
    assert "hello from a bundle\n" in "".join(getattr(e, "data", "") for e in events)


def test_run_over_tcp_with_a_token_and_refused_without(serve_factory, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    serve = serve_factory("--listen", f"127.0.0.1:{port}", "--token-file", str(token),
                          "--isolation", "none").start()
    url = f"http://127.0.0.1:{port}"
    result, modules = imported_modules("-m", "motor", "run", "--url", url, "--token-file", str(token),
                                       "--", "sh", "-c", "echo over tcp")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout == b"over tcp\n"
    assert forbidden_in(modules) == []
    assert serve.socket.exists()
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    result = subprocess.run([sys.executable, "-m", "motor", "status", "--url", url, "--token-file", str(wrong)],
                            capture_output=True, timeout=60, env=motor_env(), cwd=ROOT)
    assert result.returncode != 0
    assert result.stderr.decode().startswith("motor: refused: unauthorized"), result.stderr


@pytest.mark.parametrize("url", ["build-host:7700", "ftp://build-host/", "http://"])
def test_a_url_that_is_not_http_host_port_is_a_usage_error(url, capsys):
    from motor.cli import main

    with pytest.raises(SystemExit) as info:
        main(["status", "--url", url])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("motor: error: --url: url wants http://HOST:PORT") and len(err.splitlines()) == 1


def test_the_console_script_imports_no_more_than_python_m_motor(serve):
    """The `motor` script pip writes (bin/motor: `from motor.cli import console`, no
    importlib.metadata) takes the same lean path."""
    script = Path(sys.executable).with_name("motor")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    assert b"importlib.metadata" not in script.read_bytes() and b"pkg_resources" not in script.read_bytes()
    result, modules = imported_modules(str(script), "run", "--socket", str(serve.socket), "--", "true")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert "motor.cli" in modules and lean_forbidden_in(modules) == []
    assert not {"importlib.metadata", "pkg_resources"} & modules


#: `console()` as the console script calls it, with an atexit handler that marks a normal
#: interpreter exit on stderr
CONSOLE = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('finalized\\n'));"
           "sys.argv = ['motor', *sys.argv[1:]]; from motor.cli import console; console()")


def console(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CONSOLE, *argv], capture_output=True, timeout=60,
                          env=motor_env(), cwd=ROOT)


def test_a_client_command_leaves_without_the_interpreters_finalization_its_output_flushed(serve, tmp_path):
    """`console()` (the `motor` script, `python -m motor`): a client command ends with
    os._exit once stdout and stderr are flushed: no atexit handler runs, every byte of a
    piped answer arrives and the exit status is the command's. A usage error, and every
    command not in motor.cli.commands, ends as Python does."""
    sock = str(serve.socket)
    big = console("run", "--socket", sock, "--", "sh", "-c",
                  "head -c 300000 /dev/zero | tr '\\0' x; echo err >&2; exit 3")
    assert big.returncode == 3, big.stderr.decode()[-2000:]
    assert big.stdout == b"x" * 300000
    assert big.stderr == b"err\n"  # no "finalized": the atexit handler did not run

    submitted = console("submit", "--socket", sock, "--", "true")
    assert submitted.returncode == 0 and submitted.stderr == b""
    job_id = submitted.stdout.decode().strip()
    assert job_id
    listed = console("jobs", "--socket", sock, "--json")  # a whole JSON document through a pipe
    assert listed.returncode == 0 and listed.stderr == b""
    assert job_id in {job["job_id"] for job in json.loads(listed.stdout)}

    usage = console("status", "--socket", sock, "--no-such-option")
    assert usage.returncode == 2
    assert usage.stderr.decode().splitlines() == [
        "motor: error: unrecognized arguments: --no-such-option", "finalized"]
    helped = console("--help")
    assert helped.returncode == 0 and helped.stderr == b"finalized\n"
    tasks = console("task", "--client-dir", str(tmp_path / "client"), "list")  # not a client command
    assert tasks.returncode == 0 and tasks.stderr == b"finalized\n", tasks.stderr.decode()[-2000:]


# --- one definition of what the client and the runner share (motor/wire.py) ---------------------


def test_the_client_and_the_runner_share_one_definition_of_each_constant():
    from motor import client, records, wire
    from motor.cli import outcome
    from motor.runner import facade

    assert client.CAPABILITIES is records.CAPABILITIES is wire.CAPABILITIES
    assert outcome.BEFORE_START_CODES is records.BEFORE_START_CODES is wire.BEFORE_START_CODES
    assert client.MAX_BATCH_JOBS == facade.MAX_BATCH_JOBS == wire.MAX_BATCH_JOBS


@pytest.mark.parametrize("env", [
    {},
    {"MOTOR_SOCKET": "/run/x/m.sock"},
    {"MOTOR_STATE_DIR": "/srv/motor"},
    {"XDG_STATE_HOME": "/home/u/.state"},
    {"MOTOR_STATE_DIR": "/srv/motor", "XDG_STATE_HOME": "/x"},
    {"HOME": "/home/someone"},
])
def test_the_default_socket_is_the_configs(monkeypatch, env):
    from motor import client, config

    for name in ("MOTOR_SOCKET", "MOTOR_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert client.default_socket_str() == str(config.default_socket())
    assert client.default_socket_path() == config.default_socket()


@pytest.mark.parametrize("text", ["01a2-ff", "j/1", "a b+c", "é~_.-", "%41?&=#", "\x00\x7f", "💥"])
def test_quoting_is_urllibs(text):
    from urllib.parse import quote, urlencode

    from motor.client import _query, _quote

    assert _quote(text) == quote(text, safe="")
    params = {"from_seq": text, text: "1"}
    assert _query(params) == urlencode(params)


def test_json_bytes_are_msgspecs():
    import msgspec

    from motor.client import json_bytes

    value = {"command": ["sh", "-c", "echo \"é\" \\ \u2028"], "env": {"K": "v\n\t"}, "n": 3, "f": 1.5,
             "none": None, "yes": True, "nested": [[], {}, [1, [2]]], "big": 2**62}
    assert json_bytes(value) == msgspec.json.encode(value)
    assert msgspec.json.decode(json_bytes(value)) == value


def test_batches_split_by_count_and_by_bytes():
    from motor.client import MAX_BATCH_BYTES, MAX_BATCH_JOBS, _batches

    small = [b'{"command":["true"]}'] * (2 * MAX_BATCH_JOBS + 5)
    assert [len(b) for b in _batches(small)] == [MAX_BATCH_JOBS, MAX_BATCH_JOBS, 5]
    big = [b"x" * (MAX_BATCH_BYTES // 3)] * 7
    sizes = [len(b) for b in _batches(big)]
    assert sum(sizes) == 7 and max(sizes) == 2  # three would pass the byte bound with the commas
    alone = [b"y" * (MAX_BATCH_BYTES + 1), b"z"]
    assert list(_batches(alone)) == [[alone[0]], [b"z"]]  # one too-large request goes alone
    assert list(_batches([])) == []


def test_submit_many_sends_batches_and_a_batch_refused_whole_answers_each_of_its_jobs(one_shot, monkeypatch):
    from motor import client as client_module

    monkeypatch.setattr(client_module, "MAX_BATCH_JOBS", 2)
    too_large = b'{"refused": true, "code": "body_too_large", "detail": "too big"}'
    accepted = b'[{"job_id": "j1", "state": "queued", "workspace": "w"}, {"refused": true, "code": "runner_full", "detail": "full"}]'
    last = b'[{"job_id": "j5", "state": "queued", "workspace": "w"}]'
    server = one_shot(
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(accepted), accepted),
        b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\n\r\n%s" % (len(too_large), too_large),
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(last), last),
    )
    reqs = [{"command": ["true"], "workspace": f"w{i}"} for i in range(5)]
    with Client(server.path) as client:
        raw = client.submit_many(reqs, raw=True)
    assert [a.get("job_id") or a["code"] for a in raw] == ["j1", "runner_full", "body_too_large",
                                                           "body_too_large", "j5"]
    assert len(server.requests) == 3
    for request, names in zip(server.requests, (["w0", "w1"], ["w2", "w3"], ["w4"])):
        head, _, body = request.partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v1/jobs HTTP/1.1\r\n")
        sent = json.loads(body)
        assert [r["workspace"] for r in sent] == names
        assert all(r["capabilities"] == ["gate_jobs", "follow", "withdraw"] for r in sent)


def test_main_builds_only_the_command_it_runs_and_every_command_is_known():
    """`main` registers only the command's subparser (argparse takes ~2 ms per command to
    build); COMMAND_MODULES names every command the whole parser has."""
    from motor.cli import COMMAND_MODULES, build_parser

    whole = build_parser()
    choices = next(a for a in whole._actions if a.dest == "command").choices
    assert set(choices) == set(COMMAND_MODULES)
    one = build_parser(COMMAND_MODULES["run"], "run")
    assert list(next(a for a in one._actions if a.dest == "command").choices) == ["run"]
    args = one.parse_args(["run", "--workspace", "w"])
    assert args.workspace == "w" and args.handler.__name__ == "cmd_run"


def test_a_submit_waits_for_the_runners_answer_past_the_client_timeout(one_shot):
    """An admission may clean the disk first (up to wire.DISK_ADMIT_TIMEOUT_S): the answer to
    `POST /v1/jobs` is waited for past the client's own timeout (wire.SUBMIT_ANSWER_S); other
    requests still give up after the client's timeout."""
    from motor.client import Client, RunnerUnavailable

    record = (b'{"job_id": "j1", "state": "queued", "workspace": "w", "claim": 1, '
              b'"accepted_at_ms": 1}')
    answer = b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%s" % (len(record), record)
    server = one_shot(answer, answer, delay=1.0)
    with Client(server.path, timeout=0.2) as client:
        assert client.submit({"command": ["true"]}, raw=True)["job_id"] == "j1"
        with pytest.raises(RunnerUnavailable):
            client.call("GET", "/v1/jobs")


def test_a_cancel_and_a_withdraw_wait_for_a_busy_runners_answer_past_the_client_timeout(
        one_shot):
    """A cancel or withdraw the runner's dispatcher is too busy to take is answered after
    wire.CHANGE_TIMEOUT_S (503 `runner_busy`, the request queued): the client waits
    wire.CHANGE_ANSWER_S for that answer, past its own timeout (stop 52: `motor cancel`
    could give up first, exit 69, the cancel carried out later all the same)."""
    from motor.client import Client
    from motor.wire import CHANGE_ANSWER_S, CHANGE_TIMEOUT_S, answer_wait_s

    assert CHANGE_ANSWER_S > CHANGE_TIMEOUT_S
    assert answer_wait_s("POST", "/v1/jobs/j1/cancel") == CHANGE_ANSWER_S
    assert answer_wait_s("GET", "/v1/jobs/j1") is None
    busy = b'{"refused": true, "code": "runner_busy", "detail": "this cancel waits in its queue"}'
    answer = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (
        len(busy), busy)
    server = one_shot(answer, answer, delay=1.0)
    with Client(server.path, timeout=0.2) as client:
        for call in (lambda: client.cancel("j1"), lambda: client.withdraw("j1")):
            with pytest.raises(RefusedError) as info:
                call()
            assert info.value.refusal.code == "runner_busy"


def test_a_large_answer_is_decoded_with_the_collector_paused_and_a_small_one_is_not(
        one_shot, monkeypatch):
    """`GET /v1/status` of a deep queue is megabytes of JSON: the client decodes an answer of
    at least GC_PAUSE_BYTES with the cyclic collector paused (issue 14), and gives it back
    as it was: enabled after, still disabled if the caller had disabled it."""
    import gc

    import motor.client as client_module

    seen: list[tuple[int, bool, str]] = []
    real_loads, real_msgspec = json.loads, client_module._msgspec_decode()

    def spy(data, *args, **kwargs):
        seen.append((len(data), gc.isenabled(), "json"))
        return real_loads(data, *args, **kwargs)

    def msgspec_spy(data):
        seen.append((len(data), gc.isenabled(), "msgspec"))
        return real_msgspec(data)

    monkeypatch.setattr(client_module.json, "loads", spy)
    monkeypatch.setattr(client_module, "_msgspec_decode", lambda: msgspec_spy)
    queued = [{"job_id": f"j{i}", "state": "queued", "waiting_on": "permits"} for i in range(6000)]
    large = json.dumps({"queued": queued}).encode()
    assert len(large) >= client_module.GC_PAUSE_BYTES
    small = b'{"queued": []}'

    def answer(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    server = one_shot(answer(large), answer(small), answer(large))
    assert gc.isenabled()
    with Client(server.path) as client:
        assert client.call("GET", "/v1/status")["queued"] == queued
        assert gc.isenabled()
        assert client.call("GET", "/v1/status") == {"queued": []}
        gc.disable()
        try:
            assert len(client.call("GET", "/v1/status")["queued"]) == 6000
            assert not gc.isenabled()  # the caller's choice stands
        finally:
            gc.enable()
    # msgspec is loaded in this process: a large answer is its to decode (stop 23)
    assert seen == [(len(large), False, "msgspec"), (len(small), True, "json"),
                    (len(large), False, "msgspec")]


def test_a_client_without_msgspec_imports_it_only_for_an_answer_that_pays_for_it():
    """msgspec decodes a large answer in half json's time but costs ~25 ms to import: a
    client process that has not loaded it decodes with json below MSGSPEC_BYTES and loads
    it for a larger answer; both decode to the same value."""
    code = (
        "import json, sys\n"
        "from motor import client\n"
        "doc = {'queued': [{'job_id': 'j%d' % i, 'n': i, 'x': [1.5, None, True]} for i in range(12000)]}\n"
        "mid = json.dumps(doc).encode()\n"
        "assert client.GC_PAUSE_BYTES <= len(mid) < client.MSGSPEC_BYTES, len(mid)\n"
        "assert client._loads(mid) == doc and 'msgspec' not in sys.modules\n"
        "big = json.dumps({'queued': doc['queued'] * 12}).encode()\n"
        "assert len(big) >= client.MSGSPEC_BYTES\n"
        "assert client._loads(big) == json.loads(big) and 'msgspec' in sys.modules\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


class ScriptedRunner:
    """A Unix socket that answers the n-th request as `answers[n]` says: "close" (read the
    request, close before any answer), "cut" (the head of a 202, half its body, close), or
    a body to answer 202 with."""

    def __init__(self, path: Path, answers: list):
        self.answers = list(answers)
        self.bodies: list[dict] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(4)
        serve_each(self.sock, self._serve)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf, _ = read_until(conn, b"\r\n\r\n")
            head, _, body = buf.partition(b"\r\n\r\n")
            want = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:"))
            while len(body) < want:
                body += conn.recv(65536)
            self.bodies.append(json.loads(body))
            answer = self.answers.pop(0)
            if answer == "close":
                return
            data = json.dumps({"job_id": "01j", "state": "queued"}).encode()
            if answer == "cut":
                conn.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(data), data[: len(data) // 2]))
                return
            data = json.dumps(answer).encode()
            conn.sendall(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("lost", ["close", "cut"])
def test_a_keyed_submit_whose_answer_was_lost_is_sent_again_with_its_key(short_dir, lost):
    """The request was sent whole and its answer did not come (no answer at all, or an
    answer cut short): with an idempotency key the client sends it again, the same body,
    until one is answered (docs/protocol.md, "Idempotent submits")."""
    runner = ScriptedRunner(short_dir / "r.sock", [lost, lost, {"job_id": "01j", "state": "queued"}])
    try:
        with Client(short_dir / "r.sock") as client:
            client.RETRY_GAP_S = 0.01
            record = client.submit({"command": ["true"], "idempotency_key": "k-1"}, raw=True, retry_s=30)
        assert record == {"job_id": "01j", "state": "queued"}
        assert len(runner.bodies) == 3 and all(b == runner.bodies[0] for b in runner.bodies)
        assert runner.bodies[0]["idempotency_key"] == "k-1"
    finally:
        runner.close()


def test_an_unkeyed_submit_whose_answer_was_lost_is_not_sent_again(short_dir):
    runner = ScriptedRunner(short_dir / "r.sock", ["cut", {"job_id": "02j"}])
    try:
        with Client(short_dir / "r.sock") as client:
            with pytest.raises(RunnerUnavailable) as lost:
                client.submit({"command": ["true"]}, raw=True, retry_s=30)
        assert lost.value.sent and len(runner.bodies) == 1  # it may have been accepted: said
    finally:
        runner.close()
    # no runner at all: nothing was sent, nothing is retried, whatever the key
    with Client(short_dir / "none.sock") as client:
        started = time.monotonic()
        with pytest.raises(RunnerUnavailable) as none:
            client.submit({"command": ["true"], "idempotency_key": "k-2"}, raw=True, retry_s=30)
    assert not none.value.sent and time.monotonic() - started < 5
