"""The store's commits off the event loop while the disk is slow (issue 14, stop 27;
motor/store/pace.py, docs/operations.md "When the disk is slow").

The rule, pure (`CommitPace`), then a real store actor on a real SQLite database on trio's
real clock (real worker threads): a commit is held at a threading barrier, as a disk whose
writes stall holds it, to stage what the event loop and the readers do meanwhile.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from motor.handles import StoreHandle
from motor.records import JobRecord
from motor.store import pace as pace_module
from motor.store.actor import StoreActor
from motor.store.db import Database
from motor.store.hub import ChangeHub
from motor.store.pace import CALM_S, SLOW_COMMIT_S, STALL_BUDGET_S, WINDOW_S, CommitPace


def record(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, state="queued", workspace="w", claim=1, command=["true"],
                     accepted_at_ms=0)


# -- the rule ------------------------------------------------------------------------------


def test_fast_commits_and_a_few_slow_ones_stay_on_the_loop():
    pace = CommitPace()
    for t in range(100):
        assert pace.place(float(t)) is False
        pace.took(SLOW_COMMIT_S / 10, float(t), False)
    assert pace.slow_commits == 0 and pace.moves_off_loop == 0
    # slow ones: 0.09 s of them within a second, then the oldest leaves the window
    for i, t in enumerate((100.0, 100.5, 100.9)):
        assert pace.place(t) is False
        pace.took(0.03, t, False)
    assert pace.slow_commits == 3 and not pace.off_loop
    pace.took(0.03, 101.2, False)  # 100.5, 100.9, 101.2: 0.09 s again
    assert not pace.off_loop and pace.place(101.2) is False
    assert pace.longest_s == 0.03


def test_slow_commits_holding_the_loop_for_the_budget_move_them_off():
    pace = CommitPace()
    for t in (10.0, 10.4, 10.8):
        pace.took(0.04, t, False)  # 0.12 s within a second
    assert pace.off_loop and pace.moves_off_loop == 1 and pace.slow_commits == 3
    assert pace.place(10.8 + CALM_S / 2) is True
    pace.took(0.0001, 10.8 + CALM_S / 2, True)
    assert pace.commits_off_loop == 1
    assert pace.place(10.8 + CALM_S - 0.001) is True  # the calm counts from the slow one
    assert pace.place(10.8 + CALM_S) is False


def test_one_commit_over_the_budget_moves_them_off_and_a_slow_one_in_the_thread_keeps_them():
    pace = CommitPace()
    pace.place(0.0)
    pace.took(STALL_BUDGET_S, 0.0, False)
    assert pace.off_loop and pace.moves_off_loop == 1
    assert pace.place(CALM_S - 1) is True
    pace.took(0.2, CALM_S - 1, True)  # still slow, in the thread
    assert pace.place(CALM_S + 1) is True
    assert pace.place(2 * CALM_S - 1 + 0.001) is False
    assert pace.moves_off_loop == 1 and pace.slow_commits == 2 and pace.longest_s == 0.2
    pace.took(0.06, 30.0, False)  # back on the loop, the window starts empty
    assert not pace.off_loop


@given(st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.floats(0, 0.15, allow_nan=False)),
                max_size=80))
def test_commits_run_off_the_loop_exactly_as_the_rule_says(steps):
    """Whatever the times, against a plain model: a commit runs off the loop iff, since the
    commits last came back to the loop (or the start), slow ones on the loop summed to the
    budget within a window, and since then no CALM_S passed without a slow one."""
    pace = CommitPace()
    now, off, last_slow, window, offs = 0.0, False, float("-inf"), [], 0
    for gap, seconds in steps:
        now += gap
        if off and now - last_slow >= CALM_S:
            off = False
        placed = pace.place(now)
        assert placed is off
        offs += placed
        pace.took(seconds, now, placed)
        if seconds >= SLOW_COMMIT_S:
            last_slow = now
            if not off:
                window = [(t, s) for t, s in window if t > now - WINDOW_S] + [(now, seconds)]
                if sum(s for _, s in window) >= STALL_BUDGET_S:
                    off, window = True, []
    assert pace.commits_off_loop == offs
    assert pace.slow_commits == sum(s >= SLOW_COMMIT_S for _, s in steps)
    assert pace.longest_s == max((s for _, s in steps), default=0.0)


# -- a real store actor --------------------------------------------------------------------


class StallingDatabase(Database):
    """The real database: notes the thread of each commit; `delay` makes the next commit
    that long (a slow disk); `hold` holds the next one inside its transaction (its rows
    written, not committed) until `release` is set."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: list[int] = []
        self.delay = 0.0
        self.hold = False
        self.held, self.release = threading.Event(), threading.Event()

    def save_many(self, writes, *lock_wait):
        self.threads.append(threading.get_ident())
        return super().save_many(writes, *lock_wait)

    def _write(self, *args):
        stamped = super()._write(*args)
        if self.delay:
            delay, self.delay = self.delay, 0.0
            threading.Event().wait(delay)
        if self.hold:
            self.hold = False
            self.held.set()
            assert self.release.wait(10), "the test never released the held commit"
        return stamped


@contextlib.asynccontextmanager
async def running_store(tmp_path):
    db = StallingDatabase(tmp_path / "motor.db")
    async with trio.open_nursery() as nursery:
        store = StoreHandle(await nursery.start(StoreActor(db, ChangeHub()).run))
        yield db, store, nursery
        nursery.cancel_scope.cancel()
    db.close()


async def test_a_slow_commit_moves_the_commits_to_a_thread_and_the_loop_runs_on(tmp_path, monkeypatch):
    monkeypatch.setattr(pace_module, "CALM_S", 0.5)
    loop_thread = threading.get_ident()
    async with running_store(tmp_path) as (db, store, nursery):
        await store.save(record("a0"))  # fast: on the loop
        # the unstaged commits (a0, a3) count as slow only on a host whose disk makes them
        # so (stop 83: a probe holding every commit 10 ms); the staged ones always do
        host_slow = db.pace.slow_commits
        db.delay = 0.12
        await store.save(record("a1"))  # slow, on the loop: the next ones go off it
        assert db.threads == [loop_thread, loop_thread]
        assert db.pace.off_loop and db.pace.slow_commits == host_slow + 1

        done = []

        async def save(job_id):
            await store.save(record(job_id))
            done.append(job_id)

        db.hold = True
        nursery.start_soon(save, "a2")
        await trio.to_thread.run_sync(db.held.wait, 10)  # a2's commit: held, rows written
        # the loop runs (this task does), and a read sees only what was committed
        ticks = 0
        for _ in range(5):
            await trio.sleep(0.005)
            ticks += 1
        assert ticks == 5 and done == []
        assert db.get("a1") is not None and db.get("a2") is None
        nursery.start_soon(save, "a3")  # waits in the store's inbox behind a2
        await trio.sleep(0.01)
        assert done == []
        db.release.set()
        with trio.fail_after(10):
            while len(done) < 2:
                await trio.sleep(0.005)
        assert done == ["a2", "a3"]  # in arrival order
        assert db.get("a2") is not None and db.get("a3") is not None
        assert all(t != loop_thread for t in db.threads[2:])
        assert host_slow + 2 <= db.pace.slow_commits <= host_slow + 3  # a2; a3 if the host's
        assert db.pace.commits_off_loop == len(db.threads) - 2

        await trio.sleep(0.55)  # no slow commit for CALM_S: back on the loop
        await store.save(record("a4"))
        assert db.threads[-1] == loop_thread and not db.pace.off_loop


async def test_a_refused_group_off_the_loop_still_answers_each_save(tmp_path, monkeypatch):
    """Off the loop the group commit keeps its fallback: a group that fails is written one
    save at a time, each caller answered (here: all of them written)."""
    async with running_store(tmp_path) as (db, store, nursery):
        db.delay = 0.12
        await store.save(record("b0"))
        assert db.pace.off_loop
        failed = []
        real = Database.save_many

        def save_many(self, writes, *lock_wait):  # the first group fails whole
            if len(writes) > 1 and not failed:
                failed.append(len(writes))
                raise RuntimeError("a group that cannot be written")
            return real(self, writes, *lock_wait)

        monkeypatch.setattr(StallingDatabase, "save_many", save_many)
        db.hold = True
        answers = {}

        async def save(job_id):
            answers[job_id] = await store.save(record(job_id))

        nursery.start_soon(save, "b1")
        await trio.to_thread.run_sync(db.held.wait, 10)  # b1 alone, held in its thread
        for job_id in ("b2", "b3"):
            nursery.start_soon(save, job_id)
        await trio.sleep(0.02)
        db.release.set()
        with trio.fail_after(10):
            while len(answers) < 3:
                await trio.sleep(0.005)
        assert failed == [2] and sorted(answers) == ["b1", "b2", "b3"]
        assert all(db.get(j) is not None for j in answers)


@pytest.mark.parametrize("slow", [False, True])
async def test_expiry_runs_in_a_worker_thread_wherever_the_commits_run(tmp_path, slow):
    """Deleting expired jobs is the disk's work (3.7 ms per MiB of stored output on this
    host): since stop 63 it runs in a worker thread even while the commits run on the
    event loop, which went on serving meanwhile (before, a day's verbose jobs held it for
    seconds)."""
    loop_thread = threading.get_ident()
    async with running_store(tmp_path) as (db, store, nursery):
        done = JobRecord(job_id="c0", state="succeeded", workspace="w", claim=1,
                         command=["true"], accepted_at_ms=0)
        if slow:
            db.delay = 0.12
        await store.save(done, retain_until_ms=5)
        threads = []
        real = db.expire
        db.expire = lambda now_ms, **kw: (threads.append(threading.get_ident()),
                                          real(now_ms, **kw))[1]
        assert await store.expire(10) == ["c0"]
        assert threads[0] != loop_thread
