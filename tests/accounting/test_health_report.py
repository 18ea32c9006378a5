"""The health report of an embedded runner under trio's MockClock (jobs are real processes).

Virtual time runs fast while a job's process runs, so queue waits are not fixed numbers:
the tests compare the report with the jobs' own records instead.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import trio

import actors
from tests.conftest import read_only_tmpfs
from runner_helpers import PATIENT_S, barrier_job, in_state, poll_until, terminal_of

import motor
from motor.accounting import actor as accounting_actor
from motor.accounting.core import DAY_MS, HOUR_MS, nearest_rank
from motor.records import JobRequest, RefusedError, public_record

REQUIRED = {
    "isolation", "capacity", "disk", "admission_refusals", "underused", "repositories",
    "queue_wait_hourly",
}


def fake_sysfs(root, cpus: int = 16):
    """A /sys/devices/system/cpu tree of `cpus` CPUs (two-way SMT): claims up to 8 on any host."""
    base = root / "devices" / "system" / "cpu"
    base.mkdir(parents=True, exist_ok=True)
    (base / "online").write_text(f"0-{cpus - 1}\n")
    half = cpus // 2
    for cpu in range(cpus):
        topo = base / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True, exist_ok=True)
        core = cpu % half
        (topo / "thread_siblings_list").write_text(f"{core},{core + half}\n")
    return root


def config(tmp_path, **kw) -> motor.RunnerConfig:
    # wall time starts at real time: the keeper stamps ended_at_ms from the real clock
    base = dict(state_dir=str(tmp_path / "state"), isolation="none", free_space_floor_bytes=0,
                clock=motor.MockWallClock(epoch_ms=time.time_ns() // 1_000_000),
                sysfs_root=str(fake_sysfs(tmp_path / "sys")))
    base.update(kw)
    return motor.RunnerConfig(**base)


async def wait_until(predicate, what: str, limit: float = 3600):
    await poll_until(predicate, limit, interval=0.05)  # virtual seconds


def current_hour(report: dict) -> dict:
    return report["queue_wait_hourly"][-1]


async def test_health_reports_reserved_permits_pending_jobs_and_optional_wire_fields(
        tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=4)) as runner:
        holder = await runner.submit(barrier_job(go, weight_hint=3, workspace="a",
                                                 repository="/src/app"))

        async def running():
            return (await runner.get(holder.job_id)).state == "running"

        await wait_until(running, "holder runs")
        waiter = await runner.submit(JobRequest(command=["true"], weight_hint=2, workspace="b"))
        report = await runner.health()
        msgspec.json.encode(report)  # wire-ready as it is
        assert REQUIRED <= set(report)
        cap = report["capacity"]
        assert cap["max_weight"] == 4 and cap["held_permits"] == 3 and cap["setup_permits"] == 0
        assert cap["pending_jobs"] == 1 and cap["max_queue_depth"] == 64
        assert cap["claim_limit"] >= 1
        assert set(report["disk"]) >= {"free_bytes", "floor_bytes", "goal_bytes"}
        assert report["disk"]["floor_bytes"] == 0
        assert report["active"] == {"jobs": 1, "vcpus": 3,
                                    "by_repository": {"app": {"jobs": 1, "vcpus": 3}}}
        assert report["cpus"]["jobs"] == {holder.job_id: (await runner.get(holder.job_id)).cpus}
        # optional: host figures, all of them numbers when present
        if "host" in report:
            host = report["host"]
            assert {"load1", "load5", "load15", "logical_cpus", "available_memory_bytes"} <= set(host)
            assert all(isinstance(v, (int, float)) for v in host.values())
        # optional record field: no reservation_use until measured (absent, never zero)
        status = await runner.status()
        assert [r["job_id"] for r in status["queued"]] == [waiter.job_id]
        assert status["queued"][0]["waiting_on"] == "permits"
        assert "reservation_use" not in public_record(await runner.get(holder.job_id))
        go.write_text("")
        done = await terminal_of(runner, holder.job_id)
        assert done["state"] == "succeeded"
        use = done["reservation_use"]
        assert use["wall_time_ms"] > 0 and use["cpu_time_ms"] >= 0
        assert use["average_use_ppm"] == round(use["cpu_time_ms"] / (use["wall_time_ms"] * 3) * 1e6)
        stored = await runner.get(holder.job_id)
        assert stored.reservation_use is not None  # persisted on the record
        await terminal_of(runner, waiter.job_id)
        report = await runner.health()
        assert report["capacity"]["held_permits"] == 0 and report["capacity"]["pending_jobs"] == 0
        assert report["repositories"]["app"]["finished_jobs"] == 1
        assert report["repositories"]["app"]["jobs_by_vcpus"] == {"3": 1}
        assert report["repositories"]["(none)"]["jobs_by_vcpus"] == {"2": 1}


async def test_health_counts_admission_refusals_without_acceptance(tmp_path, autojump_clock):
    async with motor.open_runner(config(tmp_path, max_weight=2, max_queue_depth=1)) as runner:
        go = tmp_path / "go"
        holder = await runner.submit(barrier_job(go, weight_hint=2, workspace="a"))
        # a job in setup still counts in max_queue_depth: wait until it runs
        await poll_until(lambda: in_state(runner, holder.job_id, "running"), 60)
        await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="b"))  # queued
        for req in (JobRequest(command=["true"], weight_hint=0),
                    JobRequest(command=["true"], weight_hint=999),
                    JobRequest(command=["true"], weight_hint=1, workspace="c")):  # queue full
            with pytest.raises(RefusedError) as info:
                await runner.submit(req)
            assert info.value.refusal.code == "runner_full"
        with pytest.raises(RefusedError):
            await runner.submit(JobRequest(command=[]))  # malformed: not an admission decision
        assert len(await runner.jobs(all=True)) == 2  # refusals left no record
        report = await runner.health()
        assert report["admission_refusals"] == {"runner_full": 3}
        assert all(b["refusals"] == 0 for b in report["queue_wait_hourly"])  # not queue-wait refusals
        assert report["repositories"] == {}
        metrics = (await runner.metrics_text()).decode()
        assert 'motor_admission_refusals_total{code="runner_full"} 3.0' in metrics
        go.write_text("")


async def test_queue_wait_percentiles_and_refusals_expire_with_hourly_buckets(
        tmp_path, autojump_clock):
    go = tmp_path / "go"
    async with motor.open_runner(config(tmp_path, max_weight=1)) as runner:
        clock = runner.clock
        holder = await runner.submit(barrier_job(go, weight_hint=1, workspace="h"))
        waiters = [await runner.submit(JobRequest(command=["true"], weight_hint=1,
                                                  workspace=f"w{i}", queue_wait_limit_s=PATIENT_S))
                   for i in range(4)]
        refused = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="r",
                                                 queue_wait_limit_s=5))
        record = await terminal_of(runner, refused.job_id)
        assert record["state"] == "refused_before_start" and record["reason"] == "queue_wait_exceeded"
        await trio.sleep(20)  # the waiters wait 20 more virtual seconds for capacity
        go.write_text("")
        ends = [await terminal_of(runner, j.job_id) for j in [holder, *waiters]]
        assert all(e["state"] == "succeeded" for e in ends)
        report = await runner.health()
        hourly = report["queue_wait_hourly"]
        assert len(hourly) == 24
        assert hourly[-1]["hour_start_ms"] == clock.now_ms() - clock.now_ms() % HOUR_MS
        assert [b["hour_start_ms"] for b in hourly] == sorted(b["hour_start_ms"] for b in hourly)
        # what the buckets hold: each started job's capacity wait, in the hour it started
        expected: dict[int, list[int]] = {}
        for e in ends:
            hour = e["started_at_ms"] - e["started_at_ms"] % HOUR_MS
            expected.setdefault(hour, []).append(e["queue_wait_ms"])
        refusal_hour = record["ended_at_ms"] - record["ended_at_ms"] % HOUR_MS
        assert sum(b["started"] for b in hourly) == 5
        for b in hourly:
            waits = sorted(expected.get(b["hour_start_ms"], []))
            assert b["started"] == len(waits)
            assert b["p50_ms"] == nearest_rank(waits, 50) and b["p90_ms"] == nearest_rank(waits, 90)
            assert b["refusals"] == (1 if b["hour_start_ms"] == refusal_hour else 0)
        assert max(e["queue_wait_ms"] for e in ends) >= 20_000
        assert report["repositories"]["(none)"]["queue_wait_refusals"] == 1
        metrics = (await runner.metrics_text()).decode()
        assert "motor_queue_wait_hour_p90_seconds" in metrics

        await trio.sleep(25 * 3600)  # a day later every bucket (and the 24 h totals) expired
        report = await runner.health()
        assert len(report["queue_wait_hourly"]) == 24
        assert all(b["started"] == b["refusals"] == b["p50_ms"] == b["p90_ms"] == 0
                   for b in report["queue_wait_hourly"])
        assert report["repositories"] == {}


async def test_started_is_recorded_only_after_setup_with_capacity_wait(tmp_path, autojump_clock):
    cfg = config(tmp_path, max_weight=4)
    # the workspace root read-only for now: the workspace cannot be made (a file in its
    # place refuses the job since stop 49)
    with read_only_tmpfs(cfg.workspace_roots[0]) as writable:
        await _started_only_after_setup(cfg, writable, tmp_path / "go")


async def _started_only_after_setup(cfg, writable, go):
    async with motor.open_runner(cfg) as runner:
        failing = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="blocked"))

        async def attempted():
            return (await runner.get(failing.job_id)).attempts >= 2

        await wait_until(attempted, "setup failed and was retried")
        report = await runner.health()
        assert sum(b["started"] for b in report["queue_wait_hourly"]) == 0  # setup never finished
        assert report["active"]["jobs"] == 0
        writable()
        done = await terminal_of(runner, failing.job_id)
        assert done["state"] == "succeeded"

        # behind another job in the same checkout: that wait is not capacity wait
        owner = await runner.submit(barrier_job(go, weight_hint=1, workspace="shared"))
        behind = await runner.submit(JobRequest(command=["true"], weight_hint=1, workspace="shared"))
        await trio.sleep(30)
        view = await runner.get(behind.job_id)
        assert view.state == "queued" and view.waiting_on == "workspace_owner"
        go.write_text("")
        await terminal_of(runner, owner.job_id)
        late = await terminal_of(runner, behind.job_id)
        assert late["started_at_ms"] - late["accepted_at_ms"] >= 30_000
        assert late["queue_wait_ms"] == 0

        report = await runner.health()
        started = [done, await runner.get(owner.job_id), late]
        waits = sorted((r["queue_wait_ms"] if isinstance(r, dict) else r.queue_wait_ms)
                       for r in started)
        hourly = [b for b in report["queue_wait_hourly"] if b["started"]]
        assert sum(b["started"] for b in hourly) == 3
        if len(hourly) == 1:
            assert hourly[0]["p50_ms"] == nearest_rank(waits, 50)
            assert hourly[0]["p90_ms"] == nearest_rank(waits, 90)
        assert max(b["p90_ms"] for b in hourly) < 30_000  # not the time behind the owner


async def test_blocked_or_invalid_accounting_never_delays_or_changes_terminal(
        tmp_path, autojump_clock, monkeypatch):
    """A hung accounting actor with a full inbox: starts and terminals go on unchanged."""
    original = accounting_actor.AccountingActor.handle
    notes = (accounting_actor.JobStarted, accounting_actor.JobEnded,
             accounting_actor.AdmissionRefused)

    def later(self, msg):  # not at once in the sender's task: to `handle`, which hangs
        return actors.LATER if isinstance(msg, notes) else real_now(self, msg)

    async def stuck(self, msg):
        if isinstance(msg, notes):
            await trio.sleep_forever()
        return await original(self, msg)

    real_now = accounting_actor.AccountingActor.handle_now
    monkeypatch.setattr(accounting_actor.AccountingActor, "handle_now", later)
    monkeypatch.setattr(accounting_actor.AccountingActor, "handle", stuck)
    monkeypatch.setattr(accounting_actor.AccountingActor, "inbox_size", 1)
    async with motor.open_runner(config(tmp_path, max_weight=2)) as runner:
        for code in (3, 0, 7, 0):
            job = await runner.submit(JobRequest(command=["sh", "-c", f"exit {code}"],
                                                 weight_hint=1))
            # a bound in virtual seconds: it only catches a hang (a blocked cast would wait
            # forever), while real process time makes virtual time jump
            with trio.fail_after(24 * 3600):
                record = await terminal_of(runner, job.job_id)
            assert record["state"] == ("succeeded" if code == 0 else "failed")
            assert record["exit_code"] == code
        with pytest.raises(RefusedError):
            with trio.fail_after(600):
                await runner.submit(JobRequest(command=["true"], weight_hint=999))
        with trio.fail_after(600):
            report = await runner.health()  # accounting is stuck: the probe still answers
        assert report["accounting_unavailable"] is True
        assert report["capacity"]["held_permits"] == 0


async def test_repositories_are_rebuilt_from_retained_records_after_restart(tmp_path, autojump_clock):
    main = tmp_path / "src" / "app"
    gitdir = main / ".git" / "worktrees" / "wt"
    gitdir.mkdir(parents=True)
    (gitdir / "commondir").write_text("../..\n")
    linked = tmp_path / "wt"
    linked.mkdir()
    (linked / ".git").write_text(f"gitdir: {gitdir}\n")
    cfg = config(tmp_path, max_weight=4)
    repos = [(str(main), 1), (str(linked), 2), ("/elsewhere/app/.git/worktrees/x", 1),
             ("/src/tool", 4)]
    async with motor.open_runner(cfg) as runner:
        records = []
        for i, (repo, claim) in enumerate(repos):
            # `sleep 0.01`, not `true`: a job that ends within the millisecond it started has
            # no measured reservation_use (a wall time of zero), which the sum below reads
            job = await runner.submit(JobRequest(command=["sleep", "0.01"], weight_hint=claim,
                                                 workspace=f"w{i}", repository=repo))
            records.append(await terminal_of(runner, job.job_id))
        before = (await runner.health())["repositories"]
        assert set(before) == {"app", "tool"}
        app = before["app"]
        assert app["finished_jobs"] == 3 and app["jobs_by_vcpus"] == {"1": 2, "2": 1}
        wall = {r["job_id"]: r["reservation_use"]["wall_time_ms"] for r in records}
        expected = sum(r["claim"] * wall[r["job_id"]] for r in records[:3]) / 1000
        assert app["reserved_vcpu_seconds"] == pytest.approx(expected, abs=0.01)
        assert sum(b["started"] for b in (await runner.health())["queue_wait_hourly"]) == 4
    async with motor.open_runner(cfg) as runner:
        report = await runner.health()
        assert report["repositories"] == before  # rebuilt from the retained records
        assert sum(b["started"] for b in report["queue_wait_hourly"]) == 0  # hourly reset
        assert report["retained_terminal_jobs"] == 4
        metrics = (await runner.metrics_text()).decode()
        assert 'motor_repository_finished_jobs_24h{repository="app"} 3.0' in metrics
        assert 'motor_repository_jobs_by_vcpus_24h{repository="tool",vcpus="4"} 1.0' in metrics
        await trio.sleep(DAY_MS / 1000 + 3600)  # keepers stamp ends from the real clock
        report = await runner.health()
        assert report["repositories"] == {} and report["retained_terminal_jobs"] == 0
