"""Stored records and events this version cannot decode (motor/store/salvage.py): the
runner starts, runs what it can read, sets aside what it cannot, and says so.

Before stop 48 one such row stopped the runner at start-up: the accounting actor read the
live records at recovery, crashed on msgspec's `ValidationError`, and its supervisor gave up.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import msgspec
import pytest
import trio

import motor
from motor.clock import uuid7
from motor.records import Accepted, JobRecord, JobRequest, Queued, Terminal
from motor.store.db import Database
from runner_helpers import embedded_config, terminal_of


def _tamper(db_path: Path, job_id: str, change) -> None:
    """Rewrite a stored record's JSON (`change(dict) -> dict`, or bytes: the raw row)."""
    conn = sqlite3.connect(db_path)
    [(raw,)] = conn.execute("SELECT record FROM jobs WHERE job_id=?", (job_id,))
    new = change(json.loads(raw))
    conn.execute("UPDATE jobs SET record=? WHERE job_id=?",
                 (new if isinstance(new, bytes) else json.dumps(new).encode(), job_id))
    conn.commit()
    conn.close()


async def test_a_runner_with_records_it_cannot_read_starts_runs_the_rest_and_says_why(
        tmp_path, autojump_clock, caplog):
    config = embedded_config(tmp_path)
    state = Path(config.state_dir)
    state.mkdir(parents=True)
    now_ms = config.clock.now_ms()
    ids = [uuid7(now_ms + i) for i in range(4)]
    other_kind, no_command, old_done, garbage = ids
    db = Database(state / "motor.db")  # what a runner of another version left behind
    for job_id, ws in zip(ids[:2], ("a", "b")):
        db.save(JobRecord(job_id=job_id, state="queued", workspace=ws,
                          command=["sh", "-c", "echo ran"], claim=1, accepted_at_ms=now_ms,
                          queued_at_ms=now_ms),
                [Accepted(job_id=job_id, claim=1), Queued(queue_wait_budget_ms=600_000)])
    for job_id in ids[2:]:
        done = JobRecord(job_id=job_id, state="succeeded", workspace="c", command=["true"],
                         claim=1, accepted_at_ms=now_ms, ended_at_ms=now_ms, exit_code=0)
        db.save(done, [Accepted(job_id=job_id, claim=1),
                       Terminal(record=motor.records.public_record(done))],
                retain_until_ms=now_ms + 86_400_000)
    db.close()
    path = state / "motor.db"
    _tamper(path, other_kind, lambda r: {**r, "kind": "background"})  # a kind of a later motor
    _tamper(path, no_command, lambda r: {**r, "command": "echo ran"})  # what runs: not guessed
    _tamper(path, old_done, lambda r: {**r, "waiting_on": "a_new_reason"})
    _tamper(path, garbage, lambda r: b"\x00not json")
    conn = sqlite3.connect(path)  # old_done's first event: a type of a later motor
    conn.execute("UPDATE events SET data=? WHERE job_id=? AND seq=1",
                 (b'{"event":"hologram","seq":1}', old_done))
    conn.commit()
    conn.close()

    caplog.set_level(logging.WARNING, logger="motor.store")
    async with motor.open_runner(config) as runner:
        # read with its default kind, it runs
        record = await terminal_of(runner, other_kind)
        assert record["state"] == "succeeded" and record["kind"] == "job"
        # not run, not queued: lost, saying why
        set_aside = await runner.get(no_command)
        assert set_aside.state == "lost" and set_aside.reason == "record_unreadable"
        assert "`$.command`" in set_aside.detail and "queued" in set_aside.detail
        with trio.fail_after(60):  # its stored events, then the end: no wait for a start
            tags = [e.__struct_config__.tag async for e in runner.events(no_command)]
        assert tags == ["accepted", "queued"]
        assert (await runner.get(old_done)).state == "succeeded"
        with trio.fail_after(60):  # the event it cannot read is skipped, the rest replayed
            tags = [e.__struct_config__.tag async for e in runner.events(old_done)]
        assert tags == ["terminal"]
        assert (await runner.get(garbage)).state == "lost"
        status = await runner.status()
        assert no_command not in {row["job_id"] for row in status["queued"]}
        listed = {r.job_id: r.state for r in await runner.jobs(all=True)}
        assert listed[no_command] == listed[garbage] == "lost"
        fresh = await runner.submit(JobRequest(command=["true"], workspace="d"))
        assert (await terminal_of(runner, fresh.job_id))["state"] == "succeeded"
        assert runner.root.ref("accounting").restarts_in_window() == 0
        assert runner.root.ref("dispatcher").restarts_in_window() == 0
    said = [r.getMessage() for r in caplog.records if r.name == "motor.store"]
    assert any(other_kind in m and "kind='background'" in m for m in said), said
    assert any(no_command in m and "set it aside" in m for m in said), said
    assert sum(no_command in m for m in said) == 1  # once, however often it was read
    assert any(old_done in m and "event" in m and "hologram" in m for m in said), said


@pytest.mark.parametrize("field, value", [("state", "paused_by_a_later_motor"),
                                          ("workspace", 7), ("claim", "two")])
def test_a_record_whose_essential_field_cannot_be_read_is_lost_not_guessed(tmp_path, field, value):
    from motor.store.salvage import salvage, unreadable
    record = JobRecord(job_id="j1", state="queued", workspace="w", command=["true"], claim=1)
    raw = json.dumps({**msgspec.to_builtins(record), field: value}).encode()
    got = salvage(raw, "j1", "queued", ValueError("strict"))
    assert unreadable(got) and f"`$.{field}`" in got.detail


async def test_a_damaged_saved_clock_is_ignored_and_its_job_still_runs(tmp_path, autojump_clock,
                                                                      caplog):
    """A queued job's clock row (the dispatcher's clock saves) holding text where motor
    writes integers: the recovery did arithmetic on it, and the dispatcher crashed until the
    runner stopped. Now the clock in the job's record is used, and the runner says so."""
    config = embedded_config(tmp_path)
    state = Path(config.state_dir)
    state.mkdir(parents=True)
    now_ms = config.clock.now_ms()
    job_id = uuid7(now_ms)
    db = Database(state / "motor.db")
    db.save(JobRecord(job_id=job_id, state="queued", workspace="w", command=["true"], claim=1,
                      accepted_at_ms=now_ms, queued_at_ms=now_ms, ready_at_ms=now_ms,
                      queue_clock_at_ms=now_ms, queue_clock_running=True),
            [Accepted(job_id=job_id, claim=1), Queued(queue_wait_budget_ms=600_000)])
    db.close()
    conn = sqlite3.connect(state / "motor.db")
    conn.execute("INSERT INTO clocks VALUES (?, 'abc', ?, 1, ?, 'runner')",
                 (job_id, now_ms, now_ms))
    conn.commit()
    conn.close()
    caplog.set_level(logging.WARNING, logger="motor.store")
    async with motor.open_runner(config) as runner:
        assert (await terminal_of(runner, job_id))["state"] == "succeeded"
        assert runner.root.ref("dispatcher").restarts_in_window() == 0
    assert any(job_id in r.getMessage() and "clock cannot be read" in r.getMessage()
               for r in caplog.records)
