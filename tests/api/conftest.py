"""Fixtures for the API tests: a fake runner, served for real on a short-path Unix socket."""

from __future__ import annotations

import pytest

from fake_runner import FakeRunner  # tests/fake_runner.py (tests/ is on sys.path)

from motor.api import make_app, serve_api
from motor.config import RunnerConfig


@pytest.fixture
def config(short_dir) -> RunnerConfig:
    return RunnerConfig(state_dir=str(short_dir), socket=str(short_dir / "m.sock"), max_body_bytes=4096)


@pytest.fixture
async def live(config, nursery) -> FakeRunner:
    """A FakeRunner served by hypercorn on config.socket_path (scripts run in the background)."""
    fake = FakeRunner(config, nursery=nursery)
    await nursery.start(serve_api, make_app(fake), config)
    return fake
