"""A few hundred bad requests at a real `serve`: each gets a clear error, then a job runs."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT, motor_env
from tests.polling import wait_for

pytestmark = pytest.mark.e2e


def bad_bodies() -> list[tuple[bytes, str]]:
    """(body, expected code) pairs for POST /v1/jobs."""
    cases: list[tuple[bytes, str]] = [
        (b"{", "bad_request"),
        (b"not json at all", "bad_request"),
        (b"[]", "bad_request"),
        (b"null", "bad_request"),
        (b'{"command": "echo hi"}', "bad_request"),
        (b'{"command": []}', "bad_request"),
        (b'{"command": [""]}', "bad_request"),
        (b'{"command": [1, 2]}', "bad_request"),
        (b'{"command": ["true"], "weight_hint": "four"}', "bad_request"),
        (b'{"command": ["true"], "weight_hint": -1}', "bad_request"),
        (b'{"command": ["true"], "timeout_s": -5}', "bad_request"),
        (b'{"command": ["true"], "timeout_s": 1e308}', "bad_request"),
        (b'{"command": ["true"], "queue_wait_limit_s": 1e308}', "bad_request"),
        (b'{"command": ["true"], "memory_max_bytes": 1000000000000000000000000000000}',
         "bad_request"),
        (b'{"command": ["true"], "kind": "mining"}', "bad_request"),
        (b'{"command": ["true"], "env": {"A=B": "c"}}', "bad_request"),
        (b'{"command": ["true"], "siblings": ["../x"]}', "bad_request"),
        (b'{"command": ["true"], "bundle_sha256": "zz"}', "bad_request"),
        (b'{"command": ["a\\u0000b"]}', "bad_request"),
        (b'{"command": ["true"], "env": {"A": "b\\u0000c"}}', "bad_request"),
        (b"\xff\xfe\x00garbage", "bad_request"),
        (b'{"command": ["\\ud800"]}', "bad_request"),
    ]
    for name in ("..", ".", "a/b", "/abs", "../../etc", "", " ", "-x", "a" * 200, "x\ny", ".hidden"):
        cases.append((json.dumps({"command": ["true"], "workspace": name}).encode(), "bad_request"))
    return cases


def test_each_bad_request_says_what_is_wrong_with_it(serve):
    """The detail names the fault (before stop 49 an env value with a NUL byte was called a
    bad variable name; before stop 57 a queue_wait_limit_s of 1e308 overflowed the
    dispatcher's millisecond arithmetic: it crashed, the client got 500 internal_error and
    health said degraded)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)), base_url="http://motor",
                      timeout=10) as client:
        for body, detail in (
                (b'{"command": ["true"], "queue_wait_limit_s": 1e308}',
                 "queue_wait_limit_s must be a number of seconds from 0 to 1000000000"),
                (b'{"command": ["true"], "timeout_s": 1e308}',
                 "timeout_s must be a number of seconds from 0 to 1000000000"),
                (b'{"command": ["true"], "memory_max_bytes": 1000000000000000000000000000000}',
                 f"memory_max_bytes must be positive and at most {2**63 - 1}"),
                (b'{"command": ["true"], "env": {"A": "b\\u0000c"}}', "env value of 'A' must not contain NUL bytes"),
                (b'{"command": ["true"], "env": {"A=B": "c"}}', "env key 'A=B' is not a valid variable name"),
                (b'{"command": ["a\\u0000b"]}', "command arguments must not contain NUL bytes"),
                # before stop 60 msgspec's words alone: "Input data was truncated"
                (b'{"command": ["\\ud800"]}', "JSON is malformed: Input data was truncated"),
                # before stop 59 each of 5,000 siblings cost the runner's loop 35 us at admission
                (json.dumps({"command": ["true"], "siblings": [f"s{i}" for i in range(5000)]}).encode(),
                 "siblings: 5000 named, at most 256")):
            r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
            assert (r.status_code, r.json()["detail"]) == (400, detail), body
        most = client.post("/v1/jobs", json={
            "command": ["true"], "workspace": "w", "siblings": [f"s{i}" for i in range(256)]})
        assert most.status_code == 202, most.text
        # before stop 50 a from_seq past SQLite's integers was an internal_error
        job_id = client.post("/v1/jobs", json={"command": ["true"]}).json()["job_id"]
        r = client.get(f"/v1/jobs/{job_id}/events", params={"from_seq": str(10**23)})
        assert (r.status_code, r.json()["code"]) == (400, "bad_request"), r.text
        assert r.json()["detail"] == f"query parameter from_seq must be at most {2**63 - 1}"
    assert serve.cli("attach", most.json()["job_id"]).returncode == 0
    assert serve.cli_json("health")["status"] == "ok"  # no actor crashed on the way


def test_hundreds_of_bad_requests_then_a_job_runs(serve):
    transport = httpx.HTTPTransport(uds=str(serve.socket))
    rng = random.Random(7)
    seen = 0
    with httpx.Client(transport=transport, base_url="http://motor", timeout=10) as client:
        bodies = bad_bodies()
        for round_ in range(8):
            for body, code in bodies:
                r = client.post("/v1/jobs", content=body,
                                headers={"content-type": "application/json"})
                assert r.status_code == 400, (body, r.status_code, r.text)
                data = r.json()
                assert data["code"] == code and data["detail"], (body, data)
                seen += 1
            # oversized body
            r = client.post("/v1/jobs", content=b"[" + b"1," * 600_000 + b"1]")
            assert r.status_code == 413 and r.json()["code"], r.text
            seen += 1
            for path in ("/nope", "/v1/jobs/../../etc/passwd", "/v1/jobs/x/y/z", "/v2/jobs"):
                r = client.get(path)
                assert r.status_code == 404 and r.json()["code"] == "not_found", (path, r.text)
                seen += 1
            r = client.get("/v1/jobs/not-a-job-id")
            assert r.status_code == 404 and r.json()["detail"]
            r = client.delete("/v1/jobs")
            assert r.status_code in (404, 405) and r.json()["code"]
            seen += 2
        # garbage bytes straight onto the socket, and half-open connections. A few
        # connections send garbage without ever finishing a request head: they stay open
        # (hypercorn drops them after its read timeout) while everything else is served.
        idle = []
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(serve.socket))
            s.sendall(os.urandom(64).replace(b"\n", b"x"))
            idle.append(s)
        for i in range(60):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(serve.socket))
                s.settimeout(10)
                if i % 3 == 0:
                    s.sendall(os.urandom(rng.randint(1, 2048)) + b"\r\n\r\n")
                elif i % 3 == 1:
                    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n")
                else:
                    s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
                    s.shutdown(socket.SHUT_WR)
                try:
                    s.recv(4096)
                except (socket.timeout, ConnectionResetError):
                    pass
                seen += 1
    assert seen >= 300
    for s in idle:
        s.close()
    result = serve.cli("run", "--", "sh", "-c", "echo still serving")
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"still serving\n"


def test_control_characters_from_a_job_never_reach_the_operators_terminal_raw(serve):
    """A job's command (anyone who may submit writes it) is shown with its control
    characters escaped by `motor status` and `motor jobs`, and so is a detail that quotes it
    on stderr (motor/cli/text.py); before stop 50 an ESC went to the terminal as it was."""
    hostile = "sleep 30 #\x1b]0;pwned\x07\x1b[31mred\n"
    job_id = serve.cli("submit", "--", "sh", "-c", hostile).stdout.decode().strip()
    wait_for(lambda: serve.cli_json("status")["running"], what="the job to run")
    for command in ("status", "jobs"):
        out = serve.cli(command).stdout
        assert b"\x1b" not in out and b"\x07" not in out, out
        assert b"\\x1b]0;pwned\\x07\\x1b[31mred\\n" in out, out
    assert serve.cli("cancel", job_id).returncode == 0
    failed = serve.cli("run", "--", "no-such-\x1b[2J-program")
    assert failed.returncode == 127
    assert b"\x1b" not in failed.stderr and b"no-such-\\x1b[2J-program" in failed.stderr


def test_a_command_word_that_is_not_utf8_is_a_usage_error_and_nothing_is_submitted(serve):
    """`motor run -- echo $'caf\\xe9'` through the CLI process against a real runner: before
    stop 60 the client died with a UnicodeEncodeError traceback; now one line naming the
    word, exit 2, and the runner is sent nothing."""
    for argv in ([b"run", b"--", b"echo", b"caf\xe9"], [b"submit", b"--workspace", b"w\xe9", b"--", b"true"]):
        result = subprocess.run([sys.executable, "-m", "motor", argv[0], "--socket",
                                 str(serve.socket), *argv[1:]], capture_output=True,
                                timeout=30, env=motor_env(), cwd=ROOT)
        assert result.returncode == 2, result
        assert b"is not UTF-8" in result.stderr and b"Traceback" not in result.stderr, result
    assert serve.cli_json("jobs", "--all") == []
    assert serve.cli("run", "--", "echo", "café").stdout == "café\n".encode()
