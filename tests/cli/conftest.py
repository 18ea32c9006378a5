"""Fixtures for the CLI tests: the API tests' fake runner, served on a Unix socket."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "api"))

from fake_runner import FakeRunner  # noqa: E402

from motor.api import make_app, serve_api  # noqa: E402
from motor.config import RunnerConfig  # noqa: E402


@pytest.fixture
def short_dir():
    path = Path(tempfile.mkdtemp(prefix="mc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def config(short_dir) -> RunnerConfig:
    return RunnerConfig(state_dir=str(short_dir), socket=str(short_dir / "m.sock"))


@pytest.fixture
async def live(config, nursery) -> FakeRunner:
    fake = FakeRunner(config, nursery=nursery)
    await nursery.start(serve_api, make_app(fake), config)
    return fake
