"""Files an operator names (`--config`, `--token-file`, `--capacity-file`,
`--windows-slot-lock`) that are a FIFO by mistake: a clear error or warning, never a wait
(motor/smallfiles.py `read_named`). Before stop 67 the open of such a FIFO waited for a
writer for ever: `motor serve --capacity-file FIFO` never served and ignored SIGTERM;
`--token-file`/`--config` FIFO hung before starting."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest

from motor.smallfiles import read_named
from tests.conftest import ROOT, motor_env


def in_thread(fn, timeout: float = 10.0):
    """`fn()`'s result or exception, failing if it has not returned in `timeout` s."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"{fn} waited"
    return out[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "named.fifo"
    os.mkfifo(path)
    return path


def test_read_named_refuses_a_fifo_a_directory_and_a_large_file_and_reads_a_regular_one(
        tmp_path, fifo):
    how, exc = in_thread(lambda: read_named(fifo))
    assert how == "raised" and exc.errno == errno.EINVAL and exc.strerror == "not a regular file"
    how, exc = in_thread(lambda: read_named(tmp_path))
    assert how == "raised" and exc.strerror == "not a regular file"
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    how, exc = in_thread(lambda: read_named(big, limit=100))
    assert how == "raised" and exc.errno == errno.EFBIG
    assert read_named(big, limit=101) == b"x" * 101
    with pytest.raises(FileNotFoundError):
        read_named(tmp_path / "absent")


def serve_once(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "serve", *args], capture_output=True,
                          timeout=timeout, env=motor_env(), cwd=ROOT)


@pytest.mark.parametrize("flag, needle", [
    ("--token-file", "cannot read token file {fifo}: not a regular file"),
    ("--config", "cannot read config {fifo}: not a regular file"),
])
def test_serve_given_a_fifo_for_a_file_it_reads_at_once_says_so_and_exits_2(
        tmp_path, fifo, flag, needle):
    args = ["--state-dir", str(tmp_path / "state"), flag, str(fifo)]
    if flag == "--token-file":
        args += ["--listen", "127.0.0.1:0"]
    done = serve_once(*args)  # before: waited for a writer (TimeoutExpired here)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().strip() == f"motor: error: {needle.format(fifo=fifo)}"


@pytest.mark.e2e
@pytest.mark.parametrize("which", ["capacity file", "slot lock"])
def test_serve_given_a_fifo_capacity_file_or_slot_lock_serves_and_says_so(
        serve_factory, fifo, which):
    args = (["--capacity-file", str(fifo)] if which == "capacity file" else
            ["--windows-cpus", "0", "--windows-slot-lock", str(fifo)])
    serve = serve_factory("--isolation", "none", *args)
    try:
        serve.start()  # before: the capacity file's open waited for ever (never listening)
        ran = serve.cli("run", "--", "echo", "served", timeout=30)  # before: the slot lock's
        assert (ran.returncode, ran.stdout) == (0, b"served\n"), ran.stderr  # at the placement
        assert serve.stop(timeout=30) == 0
    finally:
        if serve.proc is not None and serve.proc.poll() is None:
            serve.proc.kill()  # (the code before ignored SIGTERM there)
            serve.proc.wait(10)
    if which == "capacity file":
        assert (f"capacity file {fifo} unreadable (not a regular file); treating "
                "jobs_min_bytes as undeclared") in serve.log.read_text()


@pytest.mark.e2e
def test_serve_given_a_capacity_file_that_is_not_utf8_serves_and_says_so(serve_factory, tmp_path):
    """A capacity file of bytes that are not UTF-8 text: the jobs' declared minimum is
    undeclared, the log says why, and jobs run (motor/memory/host.py)."""
    capacity = tmp_path / "capacity.json"
    capacity.write_bytes(b'{"jobs_min_bytes": \xff\xfe}')
    serve = serve_factory("--isolation", "none", "--capacity-file", str(capacity)).start()
    ran = serve.cli("run", "--", "echo", "served", timeout=30)
    assert (ran.returncode, ran.stdout) == (0, b"served\n"), ran.stderr
    assert serve.stop(timeout=30) == 0
    assert (f"capacity file {capacity} unreadable (not UTF-8 text); treating "
            "jobs_min_bytes as undeclared") in serve.log.read_text()
