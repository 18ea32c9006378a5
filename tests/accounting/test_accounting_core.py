"""The pure accounting core: reservation use, repositories, hourly buckets, /proc parsers."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from motor.accounting.core import (
    DAY_MS, HOUR_MS, HourlyQueueWait, Ledger, RepositoryWindow, host_sample,
    main_checkout_from_gitdir, nearest_rank, parse_cpuinfo, parse_loadavg, parse_meminfo,
    repository_name, reservation_use, window_entry, with_reservation_use,
)
from motor.accounting.host import HostSampler, resolve_repository
from motor.clock import uuid7
from motor.lifecycle import terminal_from_status
from motor.records import JobRecord, ReservationUse, public_record

T0 = 1_790_000_000_000 - 1_790_000_000_000 % HOUR_MS  # an hour boundary

LOADAVG = "3.52 2.08 1.51 4/1873 912345\n"
CPUINFO = "".join(
    f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\ncore id\t\t: {i // 2}\n\n"
    for i in range(12))
MEMINFO = """MemTotal:       65842000 kB
MemFree:         1234567 kB
MemAvailable:   40000000 kB
Buffers:          123456 kB
Cached:         23456789 kB
"""


def test_host_sample_parses_proc_load_threads_and_available_bytes(tmp_path):
    assert parse_loadavg(LOADAVG) == {"load1": 3.52, "load5": 2.08, "load15": 1.51,
                                      "runnable_threads": 4, "total_threads": 1873}
    assert parse_cpuinfo(CPUINFO) == 12
    assert parse_meminfo(MEMINFO) == 40_000_000 * 1024
    sample = host_sample(LOADAVG, CPUINFO, MEMINFO, cpu_count=99)
    assert sample == {"load1": 3.52, "load5": 2.08, "load15": 1.51, "runnable_threads": 4,
                      "total_threads": 1873, "logical_cpus": 12,
                      "available_memory_bytes": 40_960_000_000}
    # cpuinfo without `processor` lines (some arches): fall back to os.cpu_count()
    assert host_sample(LOADAVG, "Features: x\n", MEMINFO, cpu_count=8)["logical_cpus"] == 8
    # a kernel without MemAvailable, garbage load: those fields are absent, not zero
    partial = host_sample("garbage", CPUINFO, "MemTotal: 1 kB\n")
    assert partial == {"logical_cpus": 12}
    assert host_sample(None, None, None) is None
    # the sampler reads a /proc-like tree
    (tmp_path / "loadavg").write_text(LOADAVG)
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert HostSampler(tmp_path).sample() == sample
    assert HostSampler(tmp_path / "missing").sample() in (None, {"logical_cpus": __import__("os").cpu_count()})


def test_reservation_use_is_cpu_over_wall_times_claim():
    use = reservation_use(4, 6_000, 3_000)
    assert use == ReservationUse(cpu_time_ms=6_000, wall_time_ms=3_000, average_use_ppm=500_000)
    assert reservation_use(1, 1_500, 1_500).average_use_ppm == 1_000_000
    assert reservation_use(3, 1, 3).average_use_ppm == 111_111  # rounded
    assert reservation_use(2, 0, 1000).average_use_ppm == 0  # measured zero use is a figure
    for bad in [(2, None, 10), (2, 10, None), (2, 10, 0), (2, -1, 10), (2, 10, -5),
                (2, "10", 10), (2, 10, float("nan")), (2, float("inf"), 10), (0, 10, 10),
                (2, True, 10), (None, 10, 10)]:
        assert reservation_use(*bad) is None, bad


def _running(claim=8) -> JobRecord:
    return JobRecord(job_id=uuid7(T0), state="running", workspace="w", claim=claim,
                     cpus=list(range(claim)), started_at_ms=T0, accepted_at_ms=T0)


GARBAGE = st.one_of(st.none(), st.text(max_size=5), st.floats(allow_nan=True),
                    st.integers(min_value=-10**12, max_value=10**12), st.booleans(),
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@settings(max_examples=200, deadline=None)
@given(cpu=GARBAGE, wall=GARBAGE, exit_code=st.sampled_from([0, 1, None]),
       reason=st.sampled_from([None, "timed_out", "cancelled", "spawn_failed"]),
       drop=st.sampled_from([None, "cpu_time_ms", "wall_time_ms", "both"]))
def test_invalid_accounting_figures_never_change_the_terminal(cpu, wall, exit_code, reason, drop):
    status = {"exit_code": exit_code, "signal": None if exit_code is not None else 9,
              "reason": reason, "detail": None, "started_at_ms": T0, "ended_at_ms": T0 + 5000,
              "cpu_time_ms": cpu, "wall_time_ms": wall}
    if drop in ("cpu_time_ms", "both"):
        status.pop("cpu_time_ms")
    if drop in ("wall_time_ms", "both"):
        status.pop("wall_time_ms")
    base = terminal_from_status(_running(), status, T0 + 6000)
    accounted = with_reservation_use(base, status)
    assert msgspec.structs.replace(accounted, reservation_use=None) == base
    use = accounted.reservation_use
    if use is None:
        assert "reservation_use" not in public_record(accounted)  # absent, never zero
    else:
        assert reason != "spawn_failed"
        assert use.wall_time_ms > 0 and use.cpu_time_ms >= 0
        assert use.average_use_ppm == round(round(cpu) / (round(wall) * 8) * 1e6)
    # a lost job (no status at all) has no figures
    assert with_reservation_use(terminal_from_status(_running(), None, T0), None).reservation_use is None
    assert with_reservation_use(base, "not a dict") is base


@pytest.mark.parametrize("path, name", [
    ("/src/app", "app"), ("/src/app/", "app"), ("/src/app/.git", "app"),
    ("/src/app/.git/worktrees/feature-x", "app"), ("/src/app/.git/worktrees/w/", "app"),
    ("/srv/git/app.git", "app"), ("/srv/git/app.git/worktrees/w", "app"),
    ("relative/app", "app"), ("C:\\src\\app", "app"), (None, "(none)"), ("", "(none)"),
    ("/", "(none)"),
])
def test_repository_name_from_the_path_text(path, name):
    assert repository_name(path) == name


def test_linked_worktree_groups_under_its_main_checkout(tmp_path):
    main = tmp_path / "src" / "app"
    gitdir = main / ".git" / "worktrees" / "feature"
    gitdir.mkdir(parents=True)
    (gitdir / "commondir").write_text("../..\n")
    (gitdir / "HEAD").write_text("ref: refs/heads/feature\n")
    linked = tmp_path / "elsewhere" / "feature-checkout"
    linked.mkdir(parents=True)
    (linked / ".git").write_text(f"gitdir: {gitdir}\n")
    assert resolve_repository(str(linked)) == "app"
    assert resolve_repository(str(main)) == "app"
    assert resolve_repository(str(gitdir)) == "app"
    # relative gitdir pointer
    rel = tmp_path / "elsewhere" / "rel"
    rel.mkdir()
    (rel / ".git").write_text("gitdir: ../../src/app/.git/worktrees/feature\n")
    assert resolve_repository(str(rel)) == "app"
    # a path that does not exist here: read as text
    assert resolve_repository("/nowhere/tool/.git/worktrees/w") == "tool"
    assert main_checkout_from_gitdir("/x/app.git/worktrees/w", "../..") == "/x/app.git"


def test_nearest_rank_percentiles():
    assert nearest_rank([], 50) == 0
    assert nearest_rank([7], 90) == 7
    values = list(range(1, 11))
    assert nearest_rank(values, 50) == 5 and nearest_rank(values, 90) == 9
    assert nearest_rank([1, 2, 3, 4], 50) == 2 and nearest_rank([1, 2, 3, 4], 90) == 4


def test_hourly_buckets_zero_fill_and_expire():
    h = HourlyQueueWait()
    for i, wait in enumerate([100, 300, 200, 900, 50]):
        h.started(T0 + i * 1000, wait)
    h.refused(T0 + 10)
    h.started(T0 + HOUR_MS + 5, 7)
    report = h.report(T0 + HOUR_MS + 10)
    assert len(report) == 24 and report[-1]["hour_start_ms"] == T0 + HOUR_MS
    assert report[-2] == {"hour_start_ms": T0, "started": 5, "p50_ms": 200, "p90_ms": 900,
                          "refusals": 1}
    assert report[-1] == {"hour_start_ms": T0 + HOUR_MS, "started": 1, "p50_ms": 7, "p90_ms": 7,
                          "refusals": 0}
    assert all(b == {"hour_start_ms": b["hour_start_ms"], "started": 0, "p50_ms": 0, "p90_ms": 0,
                     "refusals": 0} for b in report[:-2])
    later = h.report(T0 + 24 * HOUR_MS + 1)  # the T0 hour left the 24 h window
    assert later[0]["hour_start_ms"] == T0 + HOUR_MS and later[0]["started"] == 1
    assert all(b["started"] == 0 for b in later[1:])
    assert h.report(T0 + 30 * HOUR_MS)[-1]["started"] == 0 and not h.buckets


def _ended(claim, wall_ms, *, end, repo="/src/app", state="succeeded", reason=None, ppm=None):
    started = None if state in ("refused_before_start", "cancelled") else end - wall_ms
    use = None
    if ppm is not None:
        use = ReservationUse(cpu_time_ms=ppm * wall_ms * claim // 1_000_000, wall_time_ms=wall_ms,
                             average_use_ppm=ppm)
    return JobRecord(job_id=uuid7(end - wall_ms), state=state, workspace="w", claim=claim,
                     repository=repo, started_at_ms=started, ended_at_ms=end, reason=reason,
                     reservation_use=use)


def test_repository_window_sums_and_expires():
    w = RepositoryWindow()
    recs = [_ended(2, 10_000, end=T0 + 1000), _ended(8, 60_000, end=T0 + 2000),
            _ended(2, 5_000, end=T0 + 3000),
            _ended(1, 0, end=T0 + 4000, state="refused_before_start", reason="queue_wait_exceeded"),
            _ended(1, 0, end=T0 + 4500, state="cancelled")]  # cancelled before start: nothing
    for r in reversed(recs):  # out of order is fine
        w.add(window_entry(r, "app"))
    assert w.report(T0 + 5000) == {"app": {
        "reserved_vcpu_seconds": 2 * 10 + 8 * 60 + 2 * 5, "finished_jobs": 3,
        "jobs_by_vcpus": {"2": 2, "8": 1}, "queue_wait_refusals": 1}}
    assert w.report(T0 + 2000 + DAY_MS)["app"]["finished_jobs"] == 1
    assert w.report(T0 + 4000 + DAY_MS) == {}
    assert not w.entries and not w.ids


def test_ledger_underused_index_and_retention():
    ledger = Ledger()
    long_idle = _ended(8, 11 * 60_000, end=T0, ppm=75_000)  # 60% of one core out of eight
    short_idle = _ended(8, 9 * 60_000, end=T0, ppm=10_000)  # under ten minutes
    long_busy = _ended(2, 20 * 60_000, end=T0, ppm=900_000)
    unmeasured = _ended(8, 30 * 60_000, end=T0)
    for r in (long_idle, short_idle, long_busy, unmeasured):
        ledger.ended(r, "app")
    report = ledger.report(T0 + 1)
    assert [u["job_id"] for u in report["underused"]] == [long_idle.job_id]
    assert report["underused"][0]["average_use_ppm"] == 75_000
    assert report["retained_terminal_jobs"] == 4
    last_id_ms = max(__import__("motor.clock").clock.uuid7_ms(r.job_id)
                     for r in (long_idle, short_idle, long_busy, unmeasured))
    gone = max(T0, last_id_ms) + DAY_MS  # 24 h after the later of end and id time
    assert ledger.report(gone - 1)["underused"] != []
    assert ledger.report(gone)["underused"] == []  # expired with its retention
    assert ledger.report(gone)["retained_terminal_jobs"] == 0
