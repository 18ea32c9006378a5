"""Helpers for tests that watch outside processes: JSON lines and bounded polling."""

from __future__ import annotations

import json
import time


def json_lines(out: bytes) -> list[dict]:
    """The JSON objects of a `--json` CLI output, one per non-empty line."""
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.02):
    """Bounded polling of an outside process's state (no sleep-and-hope: fails loudly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
