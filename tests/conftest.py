"""Fixtures shared by the whole suite: a real `python -m motor serve` and the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import load_probe
from motor.execution.spawner import cancel_keepers_under
from polling import wait_for
from private_cgroup import remove_job_groups

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.slow_spawn_s = load_probe.install()  # off unless MOTOR_TEST_SLOW_SPAWN_S is set


def pytest_report_header(config):
    if config.slow_spawn_s is not None:
        return f"load probe: each keeperd spawn held {config.slow_spawn_s} s ({load_probe.VARIABLE})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The load probe leaves the spawns of a test of the spawner's own sending alone."""
    load_probe.held = item.get_closest_marker(load_probe.MARKER) is None
    try:
        return (yield)
    finally:
        load_probe.held = True


@contextlib.contextmanager
def read_only_tmpfs(path: Path):
    """`path` a small read-only tmpfs for the block (nothing can be made in it: a start that
    fails until it is fixed); the function it yields remounts it writable. Skips the test
    where it cannot be mounted (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    try:
        yield lambda: subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def motor_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("MOTOR_SOCKET", None)
    env.pop("MOTOR_STATE_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Serve:
    """A real runner process on a temporary state dir and socket."""

    #: A command the runner is started under (e.g. nsenter into a namespace); empty: none.
    prefix: tuple[str, ...] = ()
    #: Extra environment of the next `start()` (e.g. MOTOR_FAULT); empty: none.
    env: dict[str, str] = {}

    def __init__(self, state_dir: Path, *args: str):
        self.state_dir = state_dir
        self.socket = state_dir / "motor.sock"
        self.args = ["--state-dir", str(state_dir), "--free-space-floor-bytes", "0", *args]
        self.proc: subprocess.Popen | None = None
        self.log = state_dir.parent / f"{state_dir.name}-serve.log"
        #: The background CLI clients `cli_popen` started; the fixture reaps what is left.
        self.clients: list[subprocess.Popen] = []

    def start(self, timeout: float = 30.0) -> "Serve":
        self.state_dir.mkdir(parents=True, exist_ok=True)
        seen = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "motor", "serve", *self.args],
                stdout=logf, stderr=subprocess.STDOUT, env=motor_env(self.env), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: "
                                   f"{self.log.read_bytes()[seen:].decode(errors='replace')}")
            if b"listening on" in self.log.read_bytes()[seen:]:
                return self
            time.sleep(0.02)
        raise RuntimeError(f"serve did not start: {self.log.read_text()}")

    def _signal(self, sig: int) -> None:
        """Signal the runner itself (under a prefix, the process it started)."""
        if self.prefix:
            import psutil

            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if "motor" in child.cmdline() and "serve" in child.cmdline():
                    child.send_signal(sig)
                    return
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self._signal(sig)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        self._signal(signal.SIGKILL)
        self.proc.wait(10)

    def cli(self, *args: str, timeout: float = 60.0, input: bytes | None = None,
            json_output: bool = False) -> subprocess.CompletedProcess:
        """`motor <command> --socket <ours> [--json] <rest>`."""
        flags = ["--socket", str(self.socket)] + (["--json"] if json_output else [])
        return subprocess.run(
            [sys.executable, "-m", "motor", *args[:1], *flags, *args[1:]],
            capture_output=True, timeout=timeout, env=motor_env(), cwd=ROOT, input=input)

    def cli_popen(self, *args: str, json_output: bool = False) -> subprocess.Popen:
        """Like `cli`, but started in the background (stdout and stderr piped)."""
        flags = ["--socket", str(self.socket)] + (["--json"] if json_output else [])
        client = subprocess.Popen(
            [sys.executable, "-m", "motor", *args[:1], *flags, *args[1:]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=motor_env(), cwd=ROOT)
        self.clients.append(client)
        return client

    def reap_clients(self) -> None:
        """End the background clients a test left (a failed assert skipped its wait), so
        none outlives it and their pipes are closed here, not by a later test's collector."""
        for client in self.clients:
            if client.poll() is None:
                client.kill()
                client.wait(10)
            for pipe in (client.stdout, client.stderr):
                pipe.close()

    def cli_json(self, *args: str, **kw):
        result = self.cli(*args, json_output=True, **kw)
        assert result.returncode == 0, result.stderr.decode()
        return json.loads(result.stdout)

    def wait_until_it_runs(self, job_id: str) -> None:
        """Until the runner's only running row is `job_id`'s and its set-up is done, read
        from `motor status` (the dispatcher's view): a job in set-up is a running row
        already, and the set-up's end changes the capacity between two views (a slowed
        keeperd, stop 82). The stored record may still say `setup`: a quiet job's
        `running` is saved after an output poll (`output_poll_s`)."""
        def runs():
            status = self.cli_json("status")
            return ([r["job_id"] for r in status["running"]] == [job_id]
                    and status["capacity"]["setup_permits"] == 0)

        wait_for(runs, what=f"{job_id} to run")


@pytest.fixture(autouse=True)
def _no_leaked_jobs(tmp_path):
    """A test that ends early (failed, or never released its barrier) leaves no job running."""
    yield
    cancel_keepers_under(tmp_path)


@pytest.fixture
def short_dir():
    """A directory with a short path, for what binds Unix sockets inside it: a path holds
    at most 107 bytes, and pytest's tmp_path (longer under pytest-xdist) can leave too few."""
    path = Path(tempfile.mkdtemp(prefix="mt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def serve_factory(tmp_path):
    started: list[Serve] = []

    def make(*args: str, state_dir: Path | None = None) -> Serve:
        s = Serve(state_dir or tmp_path / "state", *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.reap_clients()
        if s.proc is not None and s.proc.poll() is None:
            s.stop()
    for s in started:  # keepers of jobs still running in a test's state dir: end them
        cancel_keepers_under(s.state_dir)
    for s in started:  # and the groups of its jobs that no runner will finish
        remove_job_groups(s.state_dir)


@pytest.fixture
def serve(serve_factory):
    return serve_factory().start()
