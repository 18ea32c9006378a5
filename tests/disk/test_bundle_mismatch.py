"""A bundle whose body does not match its name is refused without restarting the disk actor
(a restart would drop its in-memory state, and a request arriving meanwhile got a 500)."""

from __future__ import annotations

import hashlib

import pytest

import motor
from motor.records import RefusedError

from runner_helpers import embedded_config


async def _chunks(data: bytes):
    yield data


async def test_a_digest_mismatch_is_refused_and_the_disk_actor_keeps_running(
        tmp_path, autojump_clock):
    good = b"a bundle body"
    sha = hashlib.sha256(good).hexdigest()
    async with motor.open_runner(embedded_config(tmp_path)) as runner:
        with pytest.raises(RefusedError) as refused:
            await runner.put_bundle(sha, _chunks(good + b"tampered"))
        assert refused.value.refusal.code == "bad_request"
        assert "mismatch" in refused.value.refusal.detail
        assert runner.actor("disk").restarts == 0
        stored = await runner.put_bundle(sha, _chunks(good))  # right away: no 500
        assert stored
        assert runner.actor("disk").restarts == 0
