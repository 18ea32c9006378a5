"""The scheduling rules through the runner (issue 11): the embedded runner's actors with
real job processes, under trio's MockClock where time must be virtual, and on the real
clock where a test stages a race with file barriers and a hooked setup step.

A *hooked setup* replaces the isolation backend's `prepare` (the last setup step before
the keeper is spawned) for the jobs of one workspace: it blocks until a barrier file
exists, or raises, which the job actor reports as a failed start.  Everything else is
the real runner.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import trio

import actors

import motor
from motor.isolation.base import Backend, IsolationError
from motor.records import JobRequest, RefusedError
from motor.scheduling import core
from runner_helpers import (PATIENT_S, at_real_speed, barrier_job, bounded, embedded_config,
                            poll_until, terminal_of as _terminal_of)


async def terminal_of(runner, job_id: str, timeout: float = 1000) -> dict:
    """The job's terminal record, within `timeout` seconds (virtual under MockClock)."""
    return await bounded(lambda: _terminal_of(runner, job_id), timeout)


async def wait_until(predicate, what: str, timeout: float = 600):
    """Poll an async predicate (virtual seconds under MockClock, real ones otherwise)."""
    return await poll_until(predicate, timeout)


async def state_of(runner, job_id: str) -> str:
    return (await runner.get(job_id)).state


def hook_setup(monkeypatch, runner, workspaces: tuple[str, ...], *, barrier: Path | None = None,
               error: str | None = None, times: int | None = None) -> list[str]:
    """Hook the setup of the jobs in `workspaces`: block until `barrier` exists, then raise
    `error` if given (the first `times` attempts only, when given). Returns the ids of the
    hooked attempts."""
    real = Backend.prepare
    hooked: list[str] = []

    def prepare(self, job_id, cpus, memory_max):
        record = runner.db.get(job_id)
        if record is not None and record.workspace in workspaces and (
                times is None or len(hooked) < times):
            hooked.append(job_id)
            if barrier is not None:
                deadline = time.monotonic() + 60
                while not barrier.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            if error is not None:
                raise IsolationError(error)
        return real(self, job_id, cpus, memory_max)

    monkeypatch.setattr(Backend, "prepare", prepare)
    return hooked


# --- item 1: runner-enforced budgets fire at their deadline ---------------------------------


async def test_runner_enforced_budgets_fire_at_their_deadline_zero_included(tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="a"))
        await wait_until(lambda: _is(runner, holder.job_id, "running"), "the holder to run")
        zero = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="b",
                                              queue_wait_limit_s=0))
        record = await terminal_of(runner, zero.job_id)
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 1000  # within a tick, not 60 s
        assert record["queue_wait_ms"] < 1000
        # behind an aged head of its own workspace that waits for capacity: the clock advances
        head = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w"))
        await trio.sleep(61)
        behind = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="w",
                                                queue_wait_limit_s=30))
        live = await runner.get(behind.job_id)
        assert (live.waiting_on, live.waiting_on_job) == ("workspace_owner", head.job_id)
        record = await terminal_of(runner, behind.job_id)
        assert record["reason"] == "queue_wait_exceeded"
        assert 30_000 <= record["queue_wait_ms"] < 31_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 31_000
        await runner.cancel(head.job_id)
        go.write_text("")
        assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"


async def _is(runner, job_id, state) -> bool:
    return await state_of(runner, job_id) == state


# --- item 4: only the seed's two blockers pause the clock -----------------------------------


async def test_a_busy_own_sibling_spends_queue_wait_while_a_workspace_owner_does_not(
        tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=4)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="lib"))
        await wait_until(lambda: _is(runner, holder.job_id, "running"), "the holder to run")
        needs_lib = await runner.submit(JobRequest(
            command=["true"], weight_hint=1, workspace="app", siblings=["lib"],
            queue_wait_limit_s=20))
        same_ws = await runner.submit(JobRequest(
            command=["true"], weight_hint=1, workspace="lib", queue_wait_limit_s=20))
        live = await runner.get(needs_lib.job_id)
        assert (live.waiting_on, live.waiting_on_job) == ("workspace_owner", holder.job_id)
        record = await terminal_of(runner, needs_lib.job_id)  # its own sibling is busy
        assert record["reason"] == "queue_wait_exceeded" and 20_000 <= record["queue_wait_ms"] < 21_000
        await trio.sleep(100)
        live = await runner.get(same_ws.job_id)  # an earlier owner of its workspace: paused
        assert live.state == "queued" and live.queue_wait_ms == 0
        go.write_text("")
        assert (await terminal_of(runner, same_ws.job_id))["state"] == "succeeded"


# --- item 2: a restart resumes clocks and enforces every budget no live follower holds ----------


async def test_a_restart_resumes_queue_wait_clocks_and_enforces_budgets_of_gone_followers(
        tmp_path, autojump_clock):
    # claims above --max-weight 1 (within the 2-CPU claim limit) wait for capacity forever:
    # their clocks advance with no job running
    cfg = embedded_config(tmp_path, max_weight=1)
    async with motor.open_runner(cfg) as runner:
        followed = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a",
                                                  queue_wait_limit_s=30), follow=True)
        unfollowed = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b",
                                                    queue_wait_limit_s=100))
        await trio.sleep(20)
        assert (await runner.get(followed.job_id)).queue_wait_ms >= 20_000
        for job in (followed, unfollowed):  # what a restart resumes from
            stored = runner.db.get(job.job_id)
            assert stored.ready_at_ms == stored.accepted_at_ms and stored.queue_clock_running
            assert stored.budget_enforced_by == ("client" if job is followed else "runner")
    async with motor.open_runner(cfg) as runner:
        resumed = await runner.get(unfollowed.job_id)
        assert resumed.state == "queued" and resumed.queue_wait_ms >= 20_000
        assert "ready_at_ms" not in msgspec.to_builtins(motor.records.public_record(resumed))
        record = await terminal_of(runner, followed.job_id)  # its follower is gone
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert 30_000 <= record["queue_wait_ms"] < 31_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 31_000
        record = await terminal_of(runner, unfollowed.job_id)
        assert 100_000 <= record["queue_wait_ms"] < 101_000
        assert record["ended_at_ms"] - record["accepted_at_ms"] < 101_000


async def test_a_restarted_dispatcher_leaves_a_live_followers_budget_to_it(tmp_path, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        job = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a",
                                             queue_wait_limit_s=5), follow=True)
        async with trio.open_nursery() as nursery:
            async def follow():
                async for _ in runner.follow(job.job_id):
                    pass

            nursery.start_soon(follow)
            await trio.sleep(1)
            with pytest.raises(TypeError):
                await runner.dispatcher.call("not a message")  # the dispatcher restarts
            await wait_until(lambda: _alive_again(runner), "the dispatcher to come back")
            await trio.sleep(30)  # the follower enforces this budget, not the runner
            live = await runner.get(job.job_id)
            assert live.state == "queued" and live.queue_wait_ms >= 30_000
            assert await runner.withdraw(job.job_id) == "withdrawn"  # what its client does
            nursery.cancel_scope.cancel()


async def test_a_dispatcher_that_crashed_between_a_placement_and_its_save_leaves_no_cpus_held(
        tmp_path, monkeypatch, caplog):
    """The dispatcher places a start's CPUs, then saves its record; crashed between the two
    (here at the save of a job admitted and started in one commit, so the job is not even
    recorded), no job actor will ever release those CPUs. Its successor has the allocator
    keep only the placements of recorded starts, then the next jobs are placed afresh."""
    from motor.scheduling import effects, machine

    real_saves, crashed = effects._saves, []

    def crash_at_the_admit_save(effect):
        if isinstance(effect, machine.SaveRecord) and effect.purpose == "admit" and not crashed:
            crashed.append(effect.record.job_id)
            raise RuntimeError("test: the dispatcher crashes before the start's save")
        return real_saves(effect)

    monkeypatch.setattr(effects, "_saves", crash_at_the_admit_save)
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        with pytest.raises(RuntimeError, match="crashes before the start's save"):
            await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a"))
        await wait_until(lambda: _alive_again(runner), "the dispatcher to come back", 60)
        [lost] = crashed
        assert runner.db.get(lost) is None  # never recorded: never accepted
        assert (await runner.health())["cpus"]["jobs"] == {}
        assert f"released the CPUs of 1 start(s) placed and never recorded: {lost}" in caplog.text
        job = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a"))
        record = await terminal_of(runner, job.job_id, 60)
        assert record["state"] == "succeeded" and sorted(record["cpus"]) == [0, 1]


async def _alive_again(runner) -> bool:
    return runner.dispatcher.alive and runner.dispatcher.restarts == 1


# --- item 3: queue depth counts jobs in setup -------------------------------------------------


async def test_queue_depth_counts_jobs_still_in_setup(tmp_path, monkeypatch):
    barrier = tmp_path / "setup-go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=4, max_queue_depth=2)) as runner:
        hooked = hook_setup(monkeypatch, runner, ("s1", "s2"), barrier=barrier)
        jobs = [await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace=ws))
                for ws in ("s1", "s2")]
        await wait_until(lambda: _all_in(runner, jobs, "setup"), "both jobs to be in setup", 60)
        with pytest.raises(RefusedError) as refused:
            await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert refused.value.refusal.code == "runner_full"
        assert "2 jobs accepted and not yet running" in refused.value.refusal.detail
        assert (await runner.status())["capacity"]["pending_jobs"] == 2
        assert (await runner.health())["admission_refusals"]["runner_full"] == 1
        barrier.write_text("")
        for job in jobs:
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
        assert sorted(hooked) == sorted(j.job_id for j in jobs)
        third = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert (await terminal_of(runner, third.job_id))["state"] == "succeeded"


async def _all_in(runner, jobs, state: str) -> bool:
    return all([await state_of(runner, j.job_id) == state for j in jobs])


# --- item 5: a failed start keeps its place in the rotation ---------------------------------


async def test_a_failed_start_keeps_its_rotation_place_through_the_runner(
        tmp_path, monkeypatch, mock_clock):
    """The clock runs at real speed and jumps only past the retry delay (the race is staged
    with barriers; it all takes well under 60 s, so no head ages and the rotation decides)."""
    mock_clock.rate = 1.0
    fail_go, x_go, a2_go = tmp_path / "fail-go", tmp_path / "x-go", tmp_path / "a2-go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        for ws in ("a", "b"):  # a dispatched before b
            job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace=ws))
            assert (await terminal_of(runner, job.job_id, 60))["state"] == "succeeded"
        hooked = hook_setup(monkeypatch, runner, ("a",), barrier=fail_go,
                            error="injected: setup failed once", times=1)
        a2 = await runner.submit(barrier_job(a2_go, weight_hint=2, workspace="a"))
        await wait_until(lambda: _is(runner, a2.job_id, "setup"), "a2 in setup", 60)
        x = await runner.submit(barrier_job(x_go, weight_hint=1, workspace="x"))
        b3 = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"))
        fail_go.write_text("")  # a2's start fails: requeued with a 1 s retry delay
        await wait_until(lambda: _is(runner, x.job_id, "running"), "x to backfill", 60)
        a2_now = await runner.get(a2.job_id)
        assert a2_now.state == "queued" and a2_now.attempts == 1 and hooked == [a2.job_id]
        mock_clock.jump(1.5)  # past a2's 1 s retry delay: now it waits for permits like b3
        await trio.sleep(0)
        x_go.write_text("")  # capacity frees: a2 (a dispatched least recently) goes before b3
        await wait_until(lambda: _left_queue(runner, (a2.job_id, b3.job_id)), "a start", 60)
        assert (await runner.get(a2.job_id)).state in ("setup", "running")
        assert (await runner.get(b3.job_id)).state == "queued"
        a2_go.write_text("")
        for job in (a2, b3):
            assert (await terminal_of(runner, job.job_id, 60))["state"] == "succeeded"
        # its failed start (its attempts say it; health's last_start_failure says why) is not
        # why it ended: before stop 56 the succeeded record kept that failure as its detail
        ended = await terminal_of(runner, a2.job_id, 60)
        assert (ended["attempts"], ended["detail"]) == (2, None), ended
        assert (await runner.get(a2.job_id)).started_at_ms <= (await runner.get(b3.job_id)).started_at_ms


async def _left_queue(runner, ids) -> bool:
    return any([await state_of(runner, j) != "queued" for j in ids])


# --- item 8: budget exhausted after failed starts keeps the failure ---------------------------


async def test_a_budget_exhausted_after_failed_starts_keeps_the_last_start_failure(
        tmp_path, monkeypatch, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        hook_setup(monkeypatch, runner, ("f",), error="injected: cgroup jobs/f is read-only")
        job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="f",
                                             queue_wait_limit_s=5))
        record = await terminal_of(runner, job.job_id)
        assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
        assert record["attempts"] >= 2
        assert "injected: cgroup jobs/f is read-only" in record["detail"], record["detail"]
        assert "start attempts failed" in record["detail"]
        assert 5_000 <= record["queue_wait_ms"] < 6_000


# --- item 7: withdraw answers match the record -----------------------------------------------


async def test_withdraw_of_an_ended_job_answers_what_happened(tmp_path, autojump_clock):
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        waiting = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="a"),
                                      follow=True)
        await runner.cancel(waiting.job_id)
        with pytest.raises(RefusedError) as refused:
            await runner.withdraw(waiting.job_id)
        assert refused.value.refusal.code == "already_ended"
        assert "cancelled" in refused.value.refusal.detail
        withdrawn = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"),
                                        follow=True)
        assert await runner.withdraw(withdrawn.job_id) == "withdrawn"
        with pytest.raises(RefusedError) as refused:  # asked again: never "withdrawn" twice
            await runner.withdraw(withdrawn.job_id)
        assert refused.value.refusal.code == "already_ended"
        assert "refused_before_start" in refused.value.refusal.detail
        ran = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c"))
        assert (await terminal_of(runner, ran.job_id))["state"] == "succeeded"
        assert await runner.withdraw(ran.job_id) == "started"  # it ran: too late


# --- the seed-named tests, through the runner (their core versions: test_rules.py *_core) -----


async def test_zero_queue_wait_withdraws_and_cancel_is_idempotent(tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="a"))
        await wait_until(lambda: _is(runner, holder.job_id, "running"), "the holder to run")
        # the client-enforced path: the follower asks, the runner's answer decides
        followed = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="b",
                                                  queue_wait_limit_s=0), follow=True)
        assert await runner.withdraw(followed.job_id) == "withdrawn"
        # the runner-enforced path (nobody follows): withdrawn at its deadline, within a tick
        alone = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="c",
                                               queue_wait_limit_s=0))
        for job in (followed, alone):
            record = await terminal_of(runner, job.job_id)
            assert (record["state"], record["reason"]) == ("refused_before_start", "queue_wait_exceeded")
            assert record["started_at_ms"] is None and record["queue_wait_ms"] < 1000
            assert record["ended_at_ms"] - record["accepted_at_ms"] < 1000
            for _ in range(2):  # cancel is idempotent on an ended job; it stays as it ended
                assert (await runner.cancel(job.job_id)).state == "refused_before_start"
            with pytest.raises(RefusedError) as refused:
                await runner.withdraw(job.job_id)
            assert refused.value.refusal.code == "already_ended"
        go.write_text("")
        assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"


async def test_dispatch_indexes_add_each_starting_weight_and_cpu_claim_before_selecting_next(
        tmp_path, autojump_clock):
    """Three one-vCPU jobs on a two-CPU host with --max-weight 2: the second start sees the
    first's permit and CPU, so the two get disjoint CPUs; the third waits for permits."""
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        if len((await runner.health())["cpus"]["allowed"]) < 2:
            pytest.skip("needs two allocatable CPUs")
        jobs = [await runner.submit(barrier_job(go, weight_hint=1, workspace=f"w{i}",
                                                queue_wait_limit_s=PATIENT_S))
                for i in range(3)]
        await wait_until(lambda: _all_in(runner, jobs[:2], "running"), "two jobs to run")
        first, second, third = [await runner.get(j.job_id) for j in jobs]
        assert len(first.cpus) == 1 and len(second.cpus) == 1
        assert set(first.cpus).isdisjoint(second.cpus)
        assert third.state == "queued" and third.waiting_on == "permits" and third.cpus is None
        status = await runner.status()
        assert status["capacity"]["held_permits"] == 2
        go.write_text("")
        for job in jobs:
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_waiting_gate_does_not_stop_or_repin_running_workers(tmp_path, autojump_clock):
    import os

    go = tmp_path / "go"
    cfg = embedded_config(tmp_path, max_weight=2, isolation="affinity")
    async with motor.open_runner(cfg) as runner:
        workers = []
        for i in range(2):
            pid_file = tmp_path / f"pid{i}"
            workers.append(await runner.submit(JobRequest(
                command=["sh", "-c", f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; "
                                     f"while [ ! -e {go} ]; do sleep 0.02; done"],
                weight_hint=1, workspace=f"w{i}")))
        await wait_until(lambda: _all_in(runner, workers, "running"), "the workers to run")
        await wait_until(lambda: _exist(tmp_path / "pid0", tmp_path / "pid1"), "their pids")
        pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
        before = [(await runner.get(w.job_id)).cpus for w in workers]
        pinned = [os.sched_getaffinity(pid) for pid in pids]
        assert [sorted(p) for p in pinned] == [sorted(c) for c in before]
        gate = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="g",
                                              gate=True, capabilities=["gate_jobs"]))
        assert gate.gate
        await trio.sleep(120)  # the gate waits (and fences) for two minutes
        live = await runner.get(gate.job_id)
        assert live.state == "queued" and live.waiting_on == "permits"
        assert [(await runner.get(w.job_id)).state for w in workers] == ["running", "running"]
        assert [(await runner.get(w.job_id)).cpus for w in workers] == before  # not re-placed
        assert [os.sched_getaffinity(pid) for pid in pids] == pinned  # not re-pinned
        go.write_text("")
        assert (await terminal_of(runner, gate.job_id))["state"] == "succeeded"


def _targz(files: dict[str, bytes]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tf.addfile(info, io.BytesIO(content))
    return buf.getvalue()


async def _exist(*paths) -> bool:
    return all(p.exists() for p in paths)


async def test_upload_fetch_and_setup_do_not_spend_queue_wait_budget(
        tmp_path, monkeypatch, autojump_clock):
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("hello.txt")
        info.size = 6
        tf.addfile(info, io.BytesIO(b"hello\n"))
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    setup_go = tmp_path / "setup-go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        hooked = hook_setup(monkeypatch, runner, ("up",), barrier=setup_go)
        job = await runner.submit(JobRequest(command=["cat", "hello.txt"], weight_hint=1,
                                             workspace="up", bundle_sha256=sha,
                                             queue_wait_limit_s=10))
        await trio.sleep(100)  # ten budgets long the upload has not arrived: no queue wait
        live = await runner.get(job.job_id)
        assert live.state == "queued" and live.queue_wait_ms == 0

        async def chunks():
            for i in range(0, len(data), 7):  # a real upload, streamed in pieces
                yield data[i:i + 7]
                await trio.sleep(5)

        await runner.put_bundle(sha, chunks())
        await wait_until(lambda: _is(runner, job.job_id, "setup"), "setup to begin")
        await trio.sleep(60)  # a long setup: six budgets
        setup_go.write_text("")
        record = await terminal_of(runner, job.job_id)
        assert record["state"] == "succeeded", record
        assert record["queue_wait_ms"] < 1000
        assert hooked == [job.job_id]


@pytest.mark.e2e
def test_queue_depth_counts_sixty_four_awaiting_bundles(serve_factory, tmp_path):
    """A real `motor serve` and its HTTP API: 64 jobs accepted while their uploads are still
    pending fill the default queue depth; the 65th request is refused runner_full before
    anything is recorded, and health counts the refusal. Once one job's bundle arrives and
    it runs, there is room again."""
    import hashlib
    import httpx

    from polling import wait_for

    serve = serve_factory().start()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(serve.socket)),
                        base_url="http://motor", timeout=30)
    with http:
        first = _targz({"x.txt": b"first\n"})
        shas = [hashlib.sha256(first).hexdigest()] + [
            hashlib.sha256(f"bundle {i}".encode()).hexdigest() for i in range(1, 65)]
        ids = []
        for i, sha in enumerate(shas[:64]):
            resp = http.post("/v1/jobs", json={"command": ["true"], "workspace": f"w{i}",
                                               "weight_hint": 1, "bundle_sha256": sha})
            assert resp.status_code == 202, resp.text
            ids.append(resp.json()["job_id"])
        status = http.get("/v1/status").json()
        assert status["capacity"]["pending_jobs"] == 64 and len(status["queued"]) == 64
        refused = http.post("/v1/jobs", json={"command": ["true"], "workspace": "w64",
                                              "bundle_sha256": shas[64]})
        assert refused.status_code == 503
        body = refused.json()
        assert body["code"] == "runner_full" and "max_queue_depth 64" in body["detail"]
        assert len(http.get("/v1/jobs", params={"all": "1"}).json()) == 64  # nothing recorded
        assert http.get("/v1/health").json()["admission_refusals"] == {"runner_full": 1}
        assert http.put(f"/v1/bundles/{shas[0]}", content=first).status_code == 201
        wait_for(lambda: http.get(f"/v1/jobs/{ids[0]}").json()["state"] == "succeeded",
                 what="the uploaded job to run")
        resp = http.post("/v1/jobs", json={"command": ["true"], "workspace": "w64",
                                           "bundle_sha256": shas[64]})
        assert resp.status_code == 202, resp.text
        for job_id in ids[1:] + [resp.json()["job_id"]]:
            http.post(f"/v1/jobs/{job_id}/cancel")


# --- issue 14: health reads capacity without building the per-job status view ----------------


async def test_health_capacity_comes_from_the_capacity_only_view(tmp_path, monkeypatch,
                                                                 autojump_clock):
    """/v1/health reports the same capacity as /v1/status, but the dispatcher builds no live
    view of any queued job for it (at 10k queued that view costs seconds)."""
    from motor.scheduling.core import Scheduler

    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        jobs = [await runner.submit(barrier_job(go, weight_hint=1, workspace=f"w{i}",
                                                queue_wait_limit_s=PATIENT_S))
                for i in range(3)]
        await wait_until(lambda: _all_in(runner, jobs[:1], "running"), "one job to run")
        # the record says running before the dispatcher has handled the job's SetupDone (a
        # cast sent after that save): compare views once the dispatcher counts it running
        await wait_until(lambda: _setup_done(runner), "the dispatcher to see it running")
        status = await runner.status()
        assert len(status["queued"]) == 2 and status["capacity"]["held_permits"] == 1
        views: list[str] = []  # the queued jobs whose live wait fields were computed
        one, many = Scheduler.wait_status, Scheduler.wait_statuses

        def counting_one(self, job_id, now):
            views.append(job_id)
            return one(self, job_id, now)

        def counting_many(self, job_ids, now):
            views.extend(job_ids)
            return many(self, job_ids, now)

        monkeypatch.setattr(Scheduler, "wait_status", counting_one)
        monkeypatch.setattr(Scheduler, "wait_statuses", counting_many)
        health = await runner.health()
        assert health["capacity"] == status["capacity"]
        assert views == [], "health built the per-job queued view"
        assert len((await runner.status())["queued"]) == 2 and len(views) == 2  # status still does
        go.write_text("")
        for job in jobs:
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_the_status_answer_over_http_is_the_status_view_spliced_from_cached_records(
        tmp_path, monkeypatch, autojump_clock):
    """GET /v1/status answers the queued jobs from the dispatcher's cache of encoded rows
    (issue 14): the JSON is exactly the embedding API's status() of the same instant (each
    queued job's status row with its live wait fields, the running ones, the capacity),
    first with every row freshly encoded, then from the cache, and after a cancel and a
    start changed the queue; `?full=1` the same with whole public records. A request right
    after another, nothing in between, is answered from the view before (stop 31:
    QueuedJson.again) with the same bytes; the first after the cancel, from the view before
    patched with the jobs that moved (stop 32: QueuedJson.patch)."""
    import httpx

    from motor.api import make_app
    from motor.scheduling.view import LIVE_FIELDS, ROW_FIELDS, QueuedJson

    go = tmp_path / "go"
    kept: list[bool] = []  # each encoded view: from the view before?
    again = QueuedJson.again

    def counted_again(self, key, t):
        pieces = again(self, key, t)
        kept.append(pieces is not None)
        return pieces

    monkeypatch.setattr(QueuedJson, "again", counted_again)
    patched: list[bool] = []  # each encoded view not from `again`: patched?
    patch = QueuedJson.patch

    def counted_patch(self, *args):
        pieces = patch(self, *args)
        patched.append(pieces is not None)
        return pieces

    monkeypatch.setattr(QueuedJson, "patch", counted_patch)

    async def app(scope, receive, send):  # as if on the Unix socket: no token needed
        await make_app(runner)({**scope, "server": None}, receive, send)

    async def both() -> tuple[dict, dict]:
        # back to back, nothing in between waits: the dispatcher's clock stands still. The
        # status rows, and the whole records (?full=1): each row is its record's row fields
        resp, full = await http.get("/v1/status"), await http.get("/v1/status?full=1")
        assert (await http.get("/v1/status")).content == resp.content and kept[-1]
        for r in (resp, full):
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            assert r.content.endswith(b"}\n")
        want_full = await runner.status(full=True)
        assert full.json() == want_full
        for kind in ("queued", "running"):
            assert resp.json()[kind] == [
                {k: v for k, v in record.items() if k in ROW_FIELDS or k in LIVE_FIELDS}
                for record in want_full[kind]]
        assert all(len(record) > 20 for record in want_full["queued"] + want_full["running"])
        return resp.json(), await runner.status()

    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        jobs = [await runner.submit(barrier_job(go, weight_hint=1, workspace=ws,
                                                siblings=["s"] if ws == "w2" else [],
                                                queue_wait_limit_s=PATIENT_S))
                for ws in ("w0", "w0", "w1", "w2", "w1")]
        await wait_until(lambda: _all_in(runner, jobs[:1], "running"), "one job to run")
        await wait_until(lambda: _setup_done(runner), "the dispatcher to see it running")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://motor") as http:
            for _ in range(2):  # encoded fresh, then from the cache with later wait fields
                got, want = await both()
                assert got == want and len(got["queued"]) == 4 and len(got["running"]) == 1
                await trio.sleep(1.5)
            assert [r["waiting_on"] for r in got["queued"]] == [
                "workspace_owner", "permits", "permits", "workspace_owner"]
            assert got["queued"][0]["queue_wait_ms"] == 0  # paused behind its workspace owner
            assert got["queued"][1]["queue_wait_ms"] >= 1500
            await runner.cancel(jobs[2].job_id)  # w1's head goes: jobs[4] heads w1 now
            patched.clear()
            got, want = await both()
            assert patched == [True, True]  # the rows, then the whole records
            assert got == want and [r["job_id"] for r in got["queued"]] == [
                jobs[1].job_id, jobs[3].job_id, jobs[4].job_id]
            go.write_text("")  # all run, one at a time
            for job in jobs[:2] + jobs[3:]:
                assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"
            # (compared once nothing moves: a job going from setup to running between the
            # two reads would differ)
            got, want = await both()
            assert got == want and got["queued"] == [] and got["running"] == []
async def _setup_done(runner) -> bool:
    return (await runner.status())["capacity"]["setup_permits"] == 0


# --- issue 15: the dispatcher never awaits the disk inside a decision -------------------------


async def test_a_long_disk_cleanup_at_admission_keeps_the_runner_serving(
        tmp_path, monkeypatch, autojump_clock):
    """The disk's admission of a submit takes 60 s (a long eviction, staged by delaying the
    disk actor's Admit): meanwhile the runner's status and health answer at once, and then
    the submit gets its record and the job runs. (When the dispatcher awaited the disk
    inside the Submit, it crashed at its 30 s call timeout.)"""
    from motor.disk.actor import DiskActor
    from motor.disk.messages import Admit

    real, real_now = DiskActor.handle, DiskActor.handle_now
    slow: list[float] = []  # when the slow admission began

    def handle_now(self, msg):  # the slow one is not answered at once: to `handle`
        if isinstance(msg, Admit) and msg.workspace == "slow":
            return actors.LATER
        return real_now(self, msg)

    async def handle(self, msg):
        if isinstance(msg, Admit) and msg.workspace == "slow":
            slow.append(trio.current_time())
            await trio.sleep(60)
        return await real(self, msg)

    monkeypatch.setattr(DiskActor, "handle_now", handle_now)
    monkeypatch.setattr(DiskActor, "handle", handle)
    go = tmp_path / "go"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="fast"))
        await wait_until(lambda: _all_in(runner, [holder], "running"), "the holder to run")
        got: dict = {}

        async def submit():
            got["record"] = await runner.submit(
                JobRequest(command=["true"], weight_hint=1, workspace="slow"))
            got["at"] = trio.current_time()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            await wait_until(lambda: _true(bool(slow)), "the disk to start its cleanup")
            status = await runner.status()
            assert [r["job_id"] for r in status["running"]] == [holder.job_id]
            assert status["queued"] == []
            assert (await runner.health())["capacity"]["held_permits"] == 1
            assert got == {} and trio.current_time() - t0 < 60  # the disk is still at it
            go.write_text("")  # (waiting for real processes lets virtual time jump)
            assert (await terminal_of(runner, holder.job_id))["state"] == "succeeded"
        # (against the admission's own start, as trio computes its deadline: t0 + 60 can
        # round below it)
        assert got["at"] >= slow[0] + 60 and got["record"].state == "queued"
        assert (await terminal_of(runner, got["record"].job_id))["state"] == "succeeded"
        assert (await runner.health())["capacity"]["held_permits"] == 0


async def _true(value: bool) -> bool:
    return value


# --- issue 14: a restart with a deep queue answers soon ----------------------------------------


async def test_a_restart_rewrites_no_queued_clock_whose_course_held(tmp_path, autojump_clock):
    """Recovery used to save every queued job's clock again, one commit each, before the
    dispatcher answered anything (7 s for 10,000 queued). Through the runner: after a
    restart, a queued job whose clock advanced before and advances again keeps its stored
    clock (the same wall time, value and course), and still resumes with the downtime."""
    go = tmp_path / "go"
    cfg = embedded_config(tmp_path, max_weight=1)
    async with motor.open_runner(cfg) as runner:
        blocker = await runner.submit(barrier_job(go, weight_hint=1, workspace="blk"))
        queued = [await runner.submit(JobRequest(command=["true"], weight_hint=1,
                                                 workspace=f"w{i}", queue_wait_limit_s=PATIENT_S))
                  for i in range(4)]
        await wait_until(lambda: _all_in(runner, [blocker], "running"), "the blocker to run")
        await trio.sleep(5)
        before = {j.job_id: runner.db.get(j.job_id) for j in queued}
        assert all(r.queue_clock_running and r.queue_clock_at_ms is not None
                   for r in before.values())
    async with motor.open_runner(cfg) as runner:
        status = await runner.status()
        assert sorted(r["job_id"] for r in status["queued"]) == sorted(before)
        for job_id, old in before.items():
            stored = runner.db.get(job_id)
            assert (stored.queue_clock_at_ms, stored.queue_wait_ms, stored.queue_clock_running) \
                == (old.queue_clock_at_ms, old.queue_wait_ms, True), "clock rewritten"
            assert (await runner.get(job_id)).queue_wait_ms >= 5_000  # resumed, not reset
        go.write_text("")
        for job in (blocker, *queued):
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_deep_workspaces_pause_only_the_clocks_at_or_ahead_of_the_fence_through_the_runner(
        tmp_path, autojump_clock):
    """The queue-wait clock rule where the core finds the clocks to change by fence order
    (issue 14, stop 41), through the embedded runner with real jobs: behind an occupied
    workspace's head a clock pauses only when the job is at or ahead of the fence (the
    oldest aged head waiting for permits); when the fence moves, the jobs between the two
    fences change course; a workspace taken after it was free pauses the jobs queued there
    (no fence then). Virtual time: heads age at 60 s, from their exact aging point (this
    test first showed a head readied at a time like 5.58 s fencing only 7 s late)."""
    go = {name: tmp_path / f"go-{name}" for name in ("hA", "hB", "c1", "b1")}
    config = embedded_config(tmp_path, max_weight=2)
    async with motor.open_runner(config) as runner:
        async def submit(name, ws):
            barrier = go.get(name)
            request = (barrier_job(barrier, weight_hint=1, workspace=ws) if barrier
                       else JobRequest(command=["true"], weight_hint=1, workspace=ws))
            return (await runner.submit(request)).job_id

        async def waited(job_id):
            live = await runner.get(job_id)
            assert live.state == "queued", live
            return live.queue_wait_ms

        hA, hB = await submit("hA", "A"), await submit("hB", "B")
        for job_id in (hA, hB):
            await wait_until(lambda: _is(runner, job_id, "running"), "a holder to run")
        t0 = trio.current_time()
        a1 = await submit("a1", "A")  # behind A's owner, ahead of every later fence
        await trio.sleep(5)
        c1 = await submit("c1", "C")  # waits for permits: the fence once it has aged
        await trio.sleep(5)
        a2 = await submit("a2", "A")  # readied after c1, before b1
        await trio.sleep(2)
        b1 = await submit("b1", "B")
        await trio.sleep(2)
        b2 = await submit("b2", "B")
        await trio.sleep(2)
        b3 = await submit("b3", "B")
        await trio.sleep(100 - (trio.current_time() - t0))

        # c1 aged at 65 s and fences: a1 (ahead of it) stays paused, a2 and B's jobs
        # (behind it) advance from then on; c1 itself advances (it waits for permits)
        assert await waited(a1) == 0
        assert 34_000 <= await waited(a2) <= 36_000
        assert 34_000 <= await waited(b2) <= 36_000
        assert await waited(c1) >= 90_000

        # B freed: c1 (older than b1) takes the permit, B stays free and its head b1, aged
        # and waiting for permits, is the fence now: a2 (readied before b1) pauses
        go["hB"].write_text("")
        await wait_until(lambda: _is(runner, c1, "running"), "c1 to start")
        a2_then, b2_then = await waited(a2), await waited(b2)
        await trio.sleep(50)
        assert await waited(a2) == a2_then
        assert await waited(b2) >= b2_then + 45_000  # B is free: it advances
        assert await waited(a1) == 0

        # c1 ends: b1 takes B after it was free, with no fence left: the jobs queued behind
        # it (b2, now B's head, and b3 behind b2) pause
        go["c1"].write_text("")
        await wait_until(lambda: _is(runner, b1, "running"), "b1 to start")
        b2_then, b3_then = await waited(b2), await waited(b3)
        await trio.sleep(50)
        assert (await waited(b2), await waited(b3)) == (b2_then, b3_then)
        assert await waited(a2) == a2_then

        for barrier in go.values():
            barrier.write_text("")
        for job_id in (hA, hB, a1, c1, a2, b1, b2, b3):
            assert (await terminal_of(runner, job_id))["state"] == "succeeded"


async def test_a_deep_workspaces_logged_clocks_pause_resume_and_run_out_on_time_through_the_runner(
        tmp_path, autojump_clock, monkeypatch):
    """A workspace queue longer than LAZY_RUN_MIN has its clocks changed as one entry of its
    run log (stop 62, docs/scheduling.md "Long runs of clocks are logged"), through the
    runner: 40 runner-enforced jobs queued in D pause while hD owns D; when hD ends, e1
    (waiting for permits, first in the rotation) takes the permit, D is free and its
    clocks advance in one logged entry; each job's budget (30 s) then runs out on time,
    though no job's clock was flipped one by one: the workspace's floor has the dispatcher
    look."""
    logged = []
    real = core.Scheduler._run_clocks

    def spy(self, ws, *args):
        before = len(self._runs.get(ws, (0, []))[1])
        result = real(self, ws, *args)
        if len(self._runs.get(ws, (0, []))[1]) > before:
            logged.append((ws, args[-1]))
        return result

    monkeypatch.setattr(core.Scheduler, "_run_clocks", spy)
    go = {name: tmp_path / f"go-{name}" for name in ("hX", "hD", "e1")}
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        hX = await runner.submit(barrier_job(go["hX"], weight_hint=1, workspace="X"))
        hD = await runner.submit(barrier_job(go["hD"], weight_hint=1, workspace="D"))
        await wait_until(lambda: _all_in(runner, [hX, hD], "running"), "the holders to run")
        t0 = trio.current_time()
        e1 = await runner.submit(barrier_job(go["e1"], weight_hint=1, workspace="E"))
        deep = [await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="D",
                                               queue_wait_limit_s=30)) for _ in range(40)]
        await trio.sleep(20)
        assert {(await runner.get(j.job_id)).queue_wait_ms for j in deep} == {0}  # paused
        with at_real_speed(autojump_clock):  # e1's start: not the budgets' 30 s in jumps
            go["hD"].write_text("")
            await wait_until(lambda: _is(runner, e1.job_id, "running"), "e1 to take the permit")
        assert ("D", core._ADVANCE) in logged, logged
        await trio.sleep(10)
        # e1 waited from t0 until D was freed, D's jobs since then: together, all the time
        e1_waited = (await runner.get(e1.job_id)).queue_wait_ms
        waits = {(await runner.get(j.job_id)).queue_wait_ms for j in deep}
        (waited,) = waits
        assert abs(e1_waited + waited - (trio.current_time() - t0) * 1000) <= 2, (e1_waited, waited)
        for job in deep:
            record = await terminal_of(runner, job.job_id)
            assert (record["state"], record["reason"]) == ("refused_before_start",
                                                           "queue_wait_exceeded")
            assert 30_000 <= record["queue_wait_ms"] < 30_100, record
        for barrier in go.values():
            barrier.write_text("")
        for job in (hX, hD, e1):
            assert (await terminal_of(runner, job.job_id))["state"] == "succeeded"


async def test_only_a_job_this_runner_accepted_skips_the_look_in_its_job_directory(
        tmp_path, monkeypatch):
    """issue 14: a job this runner accepted and has not started before (an idle runner's
    "admit", or a job that waited in its queue) has no job directory yet, so its actor does
    not look in it before the set-up. A job an earlier runner accepted (it may have been
    set up before it stopped) is looked at, as is a job found running at the start."""
    from motor.execution import jobdir

    looked: list[str] = []
    real_look = jobdir.look

    def look(job_dir):
        looked.append(Path(job_dir).name)
        return real_look(job_dir)

    monkeypatch.setattr(jobdir, "look", look)
    release = tmp_path / "release"
    config = embedded_config(tmp_path, max_weight=1)
    async with motor.open_runner(config) as runner:
        first = await runner.submit(barrier_job(release, workspace="a", weight_hint=1))
        earlier = await runner.submit(JobRequest(command=["true"], workspace="b", weight_hint=1))
        assert (await runner.get(earlier.job_id)).state == "queued"
    assert looked == []  # the admit is fresh; the queued job never started
    async with motor.open_runner(config) as runner:
        later = await runner.submit(JobRequest(command=["true"], workspace="c", weight_hint=1))
        assert (await runner.get(later.job_id)).state == "queued"
        release.touch()
        for job in (first, earlier, later):
            assert (await terminal_of(runner, job.job_id, 30))["state"] == "succeeded"
    # the first was adopted (it ran on while no runner ran), the earlier runner's queued
    # job looked at, this runner's own queued job not
    assert looked == [first.job_id, earlier.job_id]


def test_only_the_first_incarnation_of_a_fresh_start_is_fresh():
    """The job actor's factory (effects._job_factory): `fresh` holds for the incarnation
    made from the record just saved; one made after a crash looks in the directory."""
    from types import SimpleNamespace

    from motor.scheduling import effects, machine

    record = msgspec.json.decode(msgspec.json.encode({"job_id": "j"}))
    stored = SimpleNamespace(get=lambda job_id: record)
    made: list = []
    job = SimpleNamespace(records=stored, jobs_dir=Path("/nonexistent"))
    real = effects.JobExecution
    try:
        effects.JobExecution = lambda rec, deps, fresh=False: made.append((rec, fresh))
        factory = effects._job_factory(machine.StartJobActor("j", record, fresh=True), job)
        factory(), factory()
        plain = effects._job_factory(machine.StartJobActor("j", record), job)
        plain()
    finally:
        effects.JobExecution = real
    assert [fresh for _, fresh in made] == [True, False, False]


async def test_a_job_alone_behind_a_failed_start_counts_its_wait_during_the_retry_delay(
        tmp_path, monkeypatch, mock_clock):
    """Found by the differential test (stop 46), staged through the runner with virtual
    time: j1 sets up in workspace a (aged: 60 s in the queue), j2 and later j4 queue
    behind it, j3 sets up in b. At 180 s j3's start fails (it waits out its retry delay:
    an aged head, the fence) and j2 is cancelled: j4 waits alone behind j1, paused (j1
    holds a). At 181 s j1's start fails and j1 goes back to the front of a's queue for its
    retry delay: nothing holds a, so j4's clock runs. (The core kept its record of the jobs
    behind j2, with the fence of that pass, and resumed only the jobs at or ahead of that
    fence: j4 stayed paused until a was taken again.)"""
    mock_clock.rate = 1.0  # real speed, and the jumps the test makes
    go_a, go_b = tmp_path / "fail-a", tmp_path / "fail-b"
    async with motor.open_runner(embedded_config(tmp_path, max_weight=6)) as runner:
        in_a = hook_setup(monkeypatch, runner, ("a",), barrier=go_a, error="injected: a failed",
                          times=1)
        in_b = hook_setup(monkeypatch, runner, ("b",), barrier=go_b, error="injected: b failed",
                          times=1)

        def job(ws):
            return JobRequest(command=["true"], weight_hint=1, workspace=ws)

        async def held(hooked: list, job_id: str) -> None:
            """Wait until the job's setup is held at its hook: its calls to the disk actor
            (30 s timeouts) are answered, so a clock jump now times none of them out (in CI,
            stop 59, a jump that came first failed j3's start with a disk timeout)."""
            await wait_until(lambda: job_id in hooked, f"{job_id} held in its setup", 60)

        j1 = await runner.submit(job("a"))
        await held(in_a, j1.job_id)
        mock_clock.jump(60)
        j2 = await runner.submit(job("a"))
        j3 = await runner.submit(job("b"))
        await held(in_b, j3.job_id)
        mock_clock.jump(60)
        j4 = await runner.submit(job("a"))
        mock_clock.jump(60)
        go_b.write_text("")
        await wait_until(lambda: _is(runner, j3.job_id, "queued"), "j3 requeued", 60)
        assert (await runner.cancel(j2.job_id)).state == "cancelled"
        mock_clock.jump(1)
        go_a.write_text("")
        await wait_until(lambda: _is(runner, j1.job_id, "queued"), "j1 requeued", 60)
        before = await runner.get(j4.job_id)
        mock_clock.jump(0.5)  # within j1's 1 s retry delay: nothing holds workspace a
        after = await runner.get(j4.job_id)
        assert after.state == "queued" and after.queue_wait_ms - before.queue_wait_ms >= 500, (
            before.queue_wait_ms, after.queue_wait_ms)
        for each in (j1, j3, j4):
            assert (await terminal_of(runner, each.job_id, 60))["state"] == "succeeded"


async def test_a_failed_starts_retry_that_comes_due_before_its_actor_has_ended_waits_for_it(
        tmp_path, monkeypatch, autojump_clock):
    """CI, stop 59: a job's start failed; its actor told the dispatcher, which requeued it
    with its 1 s retry delay, and that delay passed (a clock jump) before the actor's exit
    was handled. The dispatcher started a new actor of the same name and crashed on it
    ("supervisor 'execution' already has a child"), then gave up: the runner was dead.
    Staged: the old actor is held after it told the dispatcher, until the dispatcher has
    tried to start the job again; then the retry runs and the job succeeds."""
    from motor.execution.actor import JobExecution
    from motor.handles import ExecutionHandle

    hold, retried = trio.Event(), trio.Event()
    real_error, real_now = JobExecution._start_error, ExecutionHandle.start_job_now
    starts: list[str] = []

    async def start_error(self, exc, prepared):
        result = await real_error(self, exc, prepared)
        await hold.wait()  # the actor has told the dispatcher; its exit is held
        return result

    def start_job_now(self, job_id, factory):
        starts.append(job_id)
        if len(starts) == 2:
            retried.set()
        return real_now(self, job_id, factory)

    monkeypatch.setattr(JobExecution, "_start_error", start_error)
    monkeypatch.setattr(ExecutionHandle, "start_job_now", start_job_now)
    async with motor.open_runner(embedded_config(tmp_path, max_weight=1)) as runner:
        hooked = hook_setup(monkeypatch, runner, ("a",), error="injected: a failed", times=1)
        job = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="a"))
        await bounded(retried.wait, 60)  # the retry came due while the old actor is held
        assert hooked == [job.job_id]
        hold.set()
        record = await terminal_of(runner, job.job_id, 60)
        assert (record["state"], record["attempts"]) == ("succeeded", 2)
        assert set(starts) == {job.job_id}
        assert runner.root.ref("dispatcher").last_failure is None  # it never crashed
        health = await runner.health()
        assert health["status"] == "ok", health
