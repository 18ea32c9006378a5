"""Store transactions per job through the embedded runner (issue 14, throughput).

A job that starts or ends in a workspace changes the course of the queue-wait clock of
every job queued in that workspace (docs/scheduling.md, "Queue-wait clock"), and each
changed clock is persisted. They used to be saved one transaction each (one commit, one
store round trip per queued job); now the clocks a message changes are saved in one. The
transactions are counted on the real SQLite connection (its statement trace), with real
job processes, on trio's real clock (under MockClock's autojump, virtual time would run
past the jobs' default queue-wait budgets while they wait for real processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trio
import trio.testing

import motor
from motor.records import JobRequest
from runner_helpers import barrier_job, embedded_config, event_of, terminal_of


async def _wait_until(predicate, what: str, timeout: float = 120):
    with trio.fail_after(timeout):
        while not await predicate():
            await trio.sleep(0.02)


def _transactions(statements: list[str]) -> list[list[str]]:
    """The committed write transactions in a statement trace, each as its statements."""
    done, current = [], None
    for sql in statements:
        if sql.startswith("BEGIN"):
            current = []
        elif sql == "COMMIT" and current is not None:
            done.append(current)
            current = None
        elif current is not None:
            current.append(sql)
    return done


async def test_a_workspace_flip_saves_its_queued_clocks_in_one_transaction(tmp_path):
    """Five jobs of workspace `a` wait for capacity (their clocks advance) behind a job of
    workspace `b` that holds it all. When it ends, the head of `a` starts and the other
    four pause behind it (their workspace's owner): four clocks change course in one
    message, and all four are persisted, in one transaction (the old code: four)."""
    go_b, go_a = tmp_path / "go-b", tmp_path / "go-a"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        holder = await runner.submit(barrier_job(go_b, weight_hint=2, workspace="b"))
        await _wait_until(lambda: _state_is(runner, holder.job_id, "running"), "b to run")
        queued = [await runner.submit(barrier_job(go_a, weight_hint=1, workspace="a"))
                  for _ in range(5)]
        head, rest = queued[0].job_id, [j.job_id for j in queued[1:]]
        await trio.testing.wait_all_tasks_blocked()
        assert all(runner.db.get(j).queue_clock_running for j in rest)  # waiting for capacity

        statements: list[str] = []
        runner.db.conn.set_trace_callback(statements.append)
        try:
            go_b.write_text("")  # b ends: the head of a starts, the rest pause behind it
            await _wait_until(lambda: _state_is(runner, head, "running"), "a's head to run")
            await _wait_until(lambda: _all_paused(runner, rest), "the clocks to be persisted")
        finally:
            runner.db.conn.set_trace_callback(None)

        with_clocks = [t for t in _transactions(statements)
                       if any(j in sql for sql in t for j in rest)]
        assert len(with_clocks) == 1, f"{len(with_clocks)} transactions saved the 4 clocks"
        [clocks] = with_clocks
        assert all(any(j in sql for sql in clocks) for j in rest)
        for job_id in rest:
            stored = runner.db.get(job_id)
            assert stored.state == "queued" and stored.queue_clock_at_ms is not None

        go_a.write_text("")
        for job in (holder, *queued):
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_jobs_of_true_cost_few_transactions_each(tmp_path):
    """Twenty-four `true` jobs over four workspaces with two slots, each start and end
    flipping the clocks of the jobs queued in its workspace. Per job: its acceptance (its
    clock saved with it), its start (`setup`), what its job actor saves (running,
    terminal), and the clock saves of the messages that flipped a workspace, one
    transaction per message. Measured on this test: 8.8-9.5 per job with each clock
    committed alone, 5.6-5.7 with a message's clocks in one transaction but a new job's
    clock saved after its record, 4.7-4.8 with `running` saved alone (stop 28), 3.0 with
    it saved with the job's end, 2.1 with the job's end saved with the next job's start
    (stop 29; the bound leaves room for ends that find no job waiting).

    What the host's speed moves is counted apart (stop 82: a slowed keeperd made 3.0 and
    3.17): clocks changed within `clock_save_s` of a save are saved alone once it is up, so
    a run that takes longer has more of those, at most one a `clock_save_s`; and a job
    that outlasts an output poll has its `running` saved alone, so the poll is stretched
    (`output_poll_s`)."""
    config = embedded_config(tmp_path, max_weight=2, output_poll_s=30.0)
    async with motor.open_runner(config) as runner:
        statements: list[str] = []
        runner.db.conn.set_trace_callback(statements.append)
        began = trio.current_time()
        try:
            jobs = [await runner.submit(JobRequest(command=["true"], weight_hint=1,
                                                   workspace=f"w{i % 4}")) for i in range(24)]
            for job in jobs:
                assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        finally:
            runner.db.conn.set_trace_callback(None)
        took = trio.current_time() - began
        clocks_alone, with_jobs = [], []
        for transaction in _transactions(statements):
            alone = all(sql.startswith("INSERT OR REPLACE INTO clocks") for sql in transaction)
            (clocks_alone if alone else with_jobs).append(transaction)
        per_job = len(with_jobs) / len(jobs)
        assert per_job <= 2.8, f"{per_job:.2f} store transactions per job"
        assert len(clocks_alone) <= 1 + took / config.clock_save_s, (len(clocks_alone), took)


async def _true(value: bool) -> bool:
    return value


async def _state_is(runner, job_id: str, state: str) -> bool:
    return (await runner.get(job_id)).state == state


async def _all_paused(runner, job_ids) -> bool:
    return all(not runner.db.get(j).queue_clock_running for j in job_ids)


@pytest.mark.parametrize("output", [False, True])
async def test_a_short_job_is_saved_in_two_transactions_its_start_with_its_end(
        tmp_path, output):
    """Issue 14: a job that ends before its first output poll, on an idle runner, costs two
    transactions: its acceptance with its start (`setup`, the dispatcher's, stop 37), and
    its end, which carries its `running` record's Started event and its last output batch
    (docs/keeper.md, "The start's record goes with the job's next write"; stop 29). The
    events keep their order and their numbers. (The output poll is stretched, so that a
    loaded host cannot make the job outlast it; the job that writes does so once its actor
    has looked at its empty log and waits for the poll, as a short job's log is at a real
    start.)"""
    go = tmp_path / "go"
    command = ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done; echo hi; echo there >&2"
               ] if output else ["true"]
    events = ["started", "output", "output", "terminal"] if output else ["started", "terminal"]
    config = embedded_config(tmp_path, max_weight=2, output_poll_s=30.0)
    async with motor.open_runner(config) as runner:
        warm = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        await terminal_of(runner, warm.job_id)
        statements: list[str] = []
        runner.db.conn.set_trace_callback(statements.append)
        try:
            job = await runner.submit(JobRequest(command=command, weight_hint=1, workspace="w"))
            if output:  # its actor has read its (empty) log and waits for the next poll
                keeper = Path(runner.config.state_dir) / "jobs" / job.job_id / "keeper.json"
                await _wait_until(lambda: _true(keeper.exists()), "the job to be spawned")
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                go.write_text("")
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
            await trio.sleep(0.1)  # nothing more is saved for it
        finally:
            runner.db.conn.set_trace_callback(None)
        mine = [t for t in _transactions(statements) if any(job.job_id in sql for sql in t)]
        assert len(mine) == 2, mine
        first = [json.loads(bytes.fromhex(sql.split("x'")[1].split("'")[0]))["event"]
                 for sql in mine[0] if sql.startswith("INSERT INTO events")]
        assert first == ["accepted", "queued"], mine[0]
        assert any(sql.startswith("INSERT INTO jobs") and "'setup'" in sql for sql in mine[0])
        last = [json.loads(bytes.fromhex(sql.split("x'")[1].split("'")[0]))["event"]
                for sql in mine[-1] if sql.startswith("INSERT INTO events")]
        assert last == events, mine[-1]
        tags = [e.__struct_config__.tag async for e in runner.events(job.job_id)]
        assert tags[-len(events):] == events, tags
        if "output" in events:
            assert runner.db.log_offset(job.job_id) > 0  # saved with them


async def test_a_quiet_running_job_has_its_start_saved_while_it_runs(tmp_path):
    """The start that waits for the job's next write is saved on its own once the job has
    run an output poll (POLL_S) without output: a follower sees `started` while the job
    still runs, and the stored record says running."""
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        job = await runner.submit(barrier_job(go, weight_hint=1, workspace="w"))
        with trio.fail_after(30):
            await event_of(runner, job.job_id, "started")  # fails if the end came first
        assert runner.db.get(job.job_id).state == "running"
        go.write_text("")
        assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_a_jobs_end_and_the_next_jobs_start_are_one_transaction(tmp_path):
    """Issue 14 (stop 29): the job actor's terminal save rides with its Finished, and the
    dispatcher writes it in the transaction of the next job's `setup` record."""
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        first = await runner.submit(barrier_job(go, weight_hint=2, workspace="a"))
        await event_of(runner, first.job_id, "started")
        second = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"))
        statements: list[str] = []
        runner.db.conn.set_trace_callback(statements.append)
        try:
            go.write_text("")
            for job in (first, second):
                assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        finally:
            runner.db.conn.set_trace_callback(None)
        [both] = [t for t in _transactions(statements) if any(first.job_id in sql for sql in t)]
        assert any(sql.startswith("UPDATE jobs SET state='setup'") and second.job_id in sql
                   for sql in both), both
