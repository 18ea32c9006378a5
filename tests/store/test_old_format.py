"""Old-format records: a state dir written by an earlier motor must load after any later
change (issue 10). tests/fixtures/state_v1 was made by motor at commit 5a54d71 (schema 1;
tests/fixtures/make_state_v1.py says how): one job ended (failed, exit 3), one running
when that runner stopped (its keeper wrote status.json afterwards), one queued.

Never re-make the fixture to make this test pass: a failure here means a change broke
the state of runners already deployed.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import trio

import motor
from motor.clock import uuid7_ms
from runner_helpers import embedded_config

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "state_v1"


def _copy_fixture(tmp_path) -> tuple[Path, dict]:
    state = tmp_path / "state"
    shutil.copytree(FIXTURE, state)
    ids = json.loads((state / "fixture.json").read_text())
    return state, ids


async def _events(runner, job_id) -> list:
    with trio.fail_after(120):
        return [e async for e in runner.events(job_id)]


def _output(events, stream="stdout") -> str:
    return "".join(e.data for e in events
                   if e.__struct_config__.tag == "output" and e.stream == stream)


async def test_a_runner_opens_a_schema_1_state_dir_and_serves_its_records(tmp_path):
    state, ids = _copy_fixture(tmp_path)
    with sqlite3.connect(state / "motor.db") as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone() == ("1",)
    conn.close()
    later = uuid7_ms(ids["queued"]) + 60_000  # a minute after the fixture: all retained
    config = embedded_config(tmp_path, clock=motor.MockWallClock(epoch_ms=later))
    async with motor.open_runner(config) as runner:
        listed = {r.job_id for r in await runner.jobs(all=True)}
        assert listed == {ids["ended"], ids["running"], ids["queued"]}

        # ended before: record, exit status and every stored event replay as they were
        ended = await runner.get(ids["ended"])
        assert ended.state == "failed" and ended.exit_code == 3
        assert ended.env == {"SECRET": "kept-in-spec"}
        events = await _events(runner, ids["ended"])
        tags = [e.__struct_config__.tag for e in events]
        assert tags[:3] == ["accepted", "queued", "started"] and tags[-1] == "terminal"
        assert _output(events) == "ended-out\n" and _output(events, "stderr") == "ended-err\n"
        assert [e.seq for e in events] == list(range(1, len(events) + 1))

        # running when the old runner stopped: adopted, its keeper's status and the rest of
        # its output (past the saved log offset) are read from its job directory
        events = await _events(runner, ids["running"])
        assert _output(events) == "running-out\nrunning-after\n"
        record = events[-1].record
        assert record["state"] == "succeeded" and record["exit_code"] == 0

        # queued: it rejoins its queue and runs now
        events = await _events(runner, ids["queued"])
        assert _output(events) == "queued-out\n"
        assert events[-1].record["state"] == "succeeded"
        assert [e.seq for e in events][:2] == [1, 2]  # the old accepted/queued events kept
