"""The store's reserve (motor/store/reserve.py): made, kept, deleted for a started job's
write on a full file system (never for an accept or a queue clock), made again later."""

from __future__ import annotations

import pytest

from motor.records import JobRecord, Output, Started, Terminal
from motor.store import reserve as R
from motor.store.db import StoreError, StoreFull, open_database
from tests.store.test_disk_full import _fill, small_tmpfs  # noqa: F401 - a fixture

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_its_size_is_a_quarter_of_the_floor_at_most_8_mib_and_none_without_a_floor():
    assert R.reserve_bytes(0) == 0
    assert R.reserve_bytes(4 * MiB) == MiB
    assert R.reserve_bytes(128 << 30) == 8 * MiB


def test_it_is_made_kept_deleted_and_made_again_no_sooner_than_its_interval(tmp_path):
    clock = Clock()
    reserve = R.Reserve(tmp_path / R.FILE_NAME, MiB, 0, clock=clock)
    assert reserve.ensure() and reserve.held
    inode = reserve.path.stat().st_ino
    assert reserve.path.stat().st_blocks * 512 >= MiB
    assert R.Reserve(reserve.path, MiB, 0).ensure()  # a whole one is kept as it is
    assert reserve.path.stat().st_ino == inode
    assert reserve.release() and not reserve.path.exists() and not reserve.held
    assert reserve.released == 1 and not reserve.release()  # none left to delete
    reserve.restore_later()  # too soon after the release
    assert not reserve.path.exists()
    clock.now += R.RESTORE_EVERY_S
    reserve.restore_later()
    assert reserve.held and reserve.path.stat().st_size == MiB
    assert reserve.describe() == {"bytes": MiB, "held": True, "released": 1}


def test_it_is_not_made_where_the_file_system_lacks_its_goal_beside_it(tmp_path):
    huge = R.free_bytes(tmp_path) + 1
    reserve = R.Reserve(tmp_path / R.FILE_NAME, MiB, huge)
    assert not reserve.ensure() and not reserve.path.exists()
    assert not reserve.path.with_name(R.FILE_NAME + ".tmp").exists()


def _record(n: int, state: str, pad: int = 300_000) -> JobRecord:
    # a large env makes the record bigger than any WAL space SQLite may reuse
    return JobRecord(job_id=f"01900000-0000-7000-8000-{n:012d}", state=state, workspace="w",
                     command=["true"], claim=1, env={"PAD": "x" * pad})


def test_on_a_full_file_system_a_started_jobs_write_deletes_it_and_an_accept_does_not(
        small_tmpfs):  # noqa: F811
    reserve = R.Reserve(small_tmpfs / R.FILE_NAME, MiB, 0)
    db = open_database(small_tmpfs, reserve=reserve)
    assert reserve.ensure()
    _fill(small_tmpfs / "filler")
    with pytest.raises(StoreFull):  # an accept: admission answers for those
        db.save(_record(1, "queued"))
    with pytest.raises(StoreFull):  # a queue clock
        db.save_many([(_record(1, "queued"), (), None, None, True)])
    assert reserve.held and reserve.released == 0
    running = _record(2, "running", 100_000)
    db.save(running, [Started(cpus=[0]), Output(stream="stdout", data="x" * 100_000)])
    assert not reserve.held and reserve.released == 1  # its start and output: on the reserve
    ended = _record(2, "failed", 100_000)
    db.save(ended, [Terminal(record=ended)])  # its end: in what is left of it
    assert db.get(ended.job_id).state == "failed"
    db.close()


def test_a_database_that_cannot_be_opened_on_a_full_file_system_is_opened_on_the_reserve(
        small_tmpfs):  # noqa: F811
    reserve = R.Reserve(small_tmpfs / R.FILE_NAME, MiB, 0)
    open_database(small_tmpfs, reserve=reserve).close()
    assert reserve.ensure()
    (small_tmpfs / "motor.db-wal").unlink(missing_ok=True)
    (small_tmpfs / "motor.db-shm").unlink(missing_ok=True)
    _fill(small_tmpfs / "filler")
    with pytest.raises(StoreError, match="cannot open job database"):
        open_database(small_tmpfs)  # no reserve: "disk I/O error"
    db = open_database(small_tmpfs, reserve=reserve)
    assert reserve.released == 1 and db.reserve is reserve
    db.close()
