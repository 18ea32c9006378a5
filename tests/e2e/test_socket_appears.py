"""`motor serve`'s socket file appears only once the runner listens on it (motor/api/server.py
`bind_listening`). Before stop 76 hypercorn bound the file and the runner listened a moment
after: a client that found the file in between, as a script waiting for it does, was
refused and told that no runner answered (stop 75's CI failed so)."""

from __future__ import annotations

import threading

import pytest

from polling import wait_for

pytestmark = pytest.mark.e2e


def test_serve_held_between_bind_and_listen_shows_no_socket_file_yet(serve_factory, tmp_path):
    gate = tmp_path / "listen"
    serve = serve_factory("--isolation", "none")
    serve.env = {"MOTOR_FAULTS": f"api.bind=wait:{gate}"}
    failed: list[BaseException] = []
    started = threading.Thread(target=lambda: _start(serve, failed), daemon=True)
    started.start()
    wait_for(lambda: (tmp_path / "listen.reached").exists() or failed, what="the runner's bind")
    assert not failed, failed
    assert not serve.socket.exists()  # before: there, and every connect to it refused
    gate.touch()
    started.join(30)
    assert not started.is_alive() and not failed, failed
    health = serve.cli("health")
    assert health.returncode == 0, health.stderr.decode()
    assert not [p.name for p in serve.state_dir.iterdir() if p.name.startswith(".motor-")]
    assert serve.stop() == 0


def _start(serve, failed: list[BaseException]) -> None:
    try:
        serve.start()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        failed.append(exc)
