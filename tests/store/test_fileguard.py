"""motor/store/fileguard.py on a real database: the path checked, the open file saved."""

from __future__ import annotations

import os
import sqlite3
import threading

import pytest
import trio

import motor
from motor.records import JobRecord, JobRequest
from motor.runner.tree import DATABASE_CHECK_S
from motor.store.db import Database
from motor.store.fileguard import DatabaseLost
from runner_helpers import embedded_config, terminal_of


def _record(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, state="queued", workspace="w", command=["true"], claim=1,
                     accepted_at_ms=1)


def _remove(path) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.unlink(f"{path}{suffix}")


def test_a_removed_database_is_found_at_the_next_commit_and_saved_back_whole(tmp_path):
    path = tmp_path / "motor.db"
    db = Database(path)
    told = []
    db.guard.on_lost = lambda: told.append(db.guard.lost)
    db.save(_record("a"))
    assert db.guard.check() is None and told == []
    _remove(path)
    db.save(_record("b"))  # found first, written all the same (to the open file)
    assert len(told) == 1 and "was removed while the runner had it open" in told[0]
    db.save(_record("c"))
    assert len(told) == 1  # told once
    db.close()
    assert db.guard.saved_to == str(path)
    again = Database(path)
    assert sorted(r.job_id for r in again.live()) == ["a", "b", "c"]
    again.close()


def test_a_save_that_fails_leaves_no_part_of_a_copy(tmp_path, monkeypatch, caplog):
    """A save of the open file that fails after its copy was begun (here its fsync) is
    logged and leaves nothing at the path or beside it: no `.saving` file that could be
    taken for the records."""
    from motor.store import fileguard

    def fail(path):
        raise OSError(5, "Input/output error")

    path = tmp_path / "motor.db"
    db = Database(path)
    db.save(_record("a"))
    _remove(path)
    monkeypatch.setattr(fileguard, "_fsync", fail)
    db.close()
    assert db.guard.saved_to is None
    assert os.listdir(tmp_path) == []
    assert "cannot save the open job database" in caplog.text


def test_a_database_replaced_by_another_file_is_left_and_saved_beside_it(tmp_path):
    path = tmp_path / "motor.db"
    db = Database(path)
    db.save(_record("a"))
    other = tmp_path / "other.db"
    sqlite3.connect(other).close()
    os.replace(other, path)
    assert "replaced by another file" in db.guard.check()
    db.close()
    assert os.path.getsize(path) == 0  # theirs, untouched
    saved = db.guard.saved_to
    assert saved.startswith(f"{path}.displaced-") and os.path.exists(saved)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".saving")]
    with sqlite3.connect(saved) as conn:
        assert [r[0] for r in conn.execute("SELECT job_id FROM jobs")] == ["a"]


def test_a_read_connection_opened_after_the_removal_creates_no_file(tmp_path):
    path = tmp_path / "motor.db"
    db = Database(path)
    db.save(_record("a"))
    _remove(path)
    errors = []

    def read():  # a thread's first read opens its own connection
        try:
            db.get("a")
        except sqlite3.Error as exc:
            errors.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert errors and not path.exists()  # an error, never an empty motor.db
    db.close()
    assert Database(path).get("a") is not None


@pytest.mark.parametrize("name", ["motor.db", "we?ird #name%.db"])
def test_an_intact_database_is_never_saved_again(tmp_path, name):
    db = Database(tmp_path / name)
    db.save(_record("a"))
    assert db.get("a") is not None  # its read connection opened the path's URI
    assert db.guard.check() is None
    db.close()
    assert db.guard.saved_to is None
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(name + "-")) == [name]


async def test_an_idle_runner_finds_its_database_removed_and_stops_with_it_saved(
        tmp_path, autojump_clock):
    """No commit, no health probe: the runner's own check (every DATABASE_CHECK_S) finds
    the removal, stops the runner, and the records are back at the path."""
    config = embedded_config(tmp_path)
    with pytest.raises(BaseExceptionGroup) as raised:
        async with motor.open_runner(config) as runner:
            job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
            _remove(runner.db.path)
            await trio.sleep(DATABASE_CHECK_S + 1)
            pytest.fail("the runner went on with its database removed")
    [lost] = _leaves(raised.value.subgroup(DatabaseLost))
    assert "was removed while the runner had it open" in str(lost)
    assert job.job_id in _job_ids_at(runner.db.path)


def _job_ids_at(path) -> set[str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {row[0] for row in conn.execute("SELECT job_id FROM jobs")}


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [leaf for exc in group.exceptions
            for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])]
