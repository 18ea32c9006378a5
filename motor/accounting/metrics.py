"""`GET /metrics`: the health report's figures in the Prometheus text format.

A custom prometheus_client Collector reads the latest health report; each runner has its
own CollectorRegistry (never the process-global one, so two runners in one process, as in
tests, never collide). See docs/accounting.md for the metric names.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _ms_to_s(value: Any) -> float | None:
    v = _num(value)
    return None if v is None else v / 1000.0


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily | None:
    v = _num(value)
    return None if v is None else GaugeMetricFamily(name, doc, value=v)


class HealthCollector(Collector):
    """Turns a health report (Runner.health()) into metric families."""

    def __init__(self) -> None:
        self.report: dict = {}

    def describe(self):
        return []  # collected on demand; nothing to register up front

    def collect(self) -> Iterator:
        r = self.report or {}
        cap = r.get("capacity") or {}
        disk = r.get("disk") or {}
        host = r.get("host") or {}
        active = r.get("active") or {}
        store = r.get("store") or {}
        last_checkpoint = store.get("last_checkpoint") or {}
        singles = [
            ("motor_capacity_max_weight", "bound on the sum of running and setting-up claims",
             cap.get("max_weight")),
            ("motor_capacity_claim_limit", "largest claim this runner accepts", cap.get("claim_limit")),
            ("motor_permits_held", "vCPU permits held by running and setting-up jobs",
             cap.get("held_permits")),
            ("motor_permits_setup", "vCPU permits held by jobs in workspace setup",
             cap.get("setup_permits")),
            ("motor_queue_max_depth", "bound on accepted, not yet started jobs",
             cap.get("max_queue_depth")),
            ("motor_queue_pending_jobs", "accepted jobs not yet started", cap.get("pending_jobs")),
            ("motor_running_jobs", "jobs that finished setup and run", active.get("jobs")),
            ("motor_running_vcpus", "claims of the jobs that run", active.get("vcpus")),
            ("motor_disk_free_bytes", "free bytes on the state filesystem", disk.get("free_bytes")),
            ("motor_disk_floor_bytes", "free-space floor (admission refuses below it)",
             disk.get("floor_bytes")),
            ("motor_disk_goal_bytes", "free-space eviction goal", disk.get("goal_bytes")),
            ("motor_disk_free_inodes", "free inodes on the state filesystem (where it counts "
             "them)", disk.get("free_inodes")),
            ("motor_disk_floor_inodes", "free-inode floor (admission refuses below it)",
             disk.get("floor_inodes")),
            ("motor_underused_jobs", "retained jobs that ran over 10 minutes below 25% of "
             "their reservation", len(r.get("underused") or [])),
            ("motor_retained_terminal_jobs", "retained terminal job records",
             r.get("retained_terminal_jobs")),
            ("motor_host_load1", "host load average over 1 minute", host.get("load1")),
            ("motor_host_load5", "host load average over 5 minutes", host.get("load5")),
            ("motor_host_load15", "host load average over 15 minutes", host.get("load15")),
            ("motor_host_logical_cpus", "logical CPU threads of the host", host.get("logical_cpus")),
            ("motor_host_available_memory_bytes", "MemAvailable of the host",
             host.get("available_memory_bytes")),
            ("motor_store_last_checkpoint_seconds", "how long the store's last WAL checkpoint "
             "took (in a worker thread)", _ms_to_s(last_checkpoint.get("ms"))),
            ("motor_store_last_checkpoint_writes_paused_seconds", "how long the store's writes "
             "waited for its last WAL checkpoint's final step", _ms_to_s(
                 last_checkpoint.get("writes_paused_ms"))),
            ("motor_store_commits_off_loop", "1 while the store's commits run in a worker "
             "thread (the disk slow), 0 on the event loop",
             None if "commits_run_in" not in store else float(store["commits_run_in"] == "thread")),
            ("motor_store_locked_seconds", "how long another connection has held the job "
             "database's write lock, as the store's writes find it (0: not held)",
             _ms_to_s(store.get("locked_ms"))),
        ]
        for name, doc, value in singles:
            family = _gauge(name, doc, value)
            if family is not None:
                yield family

        if "status" in r:
            yield GaugeMetricFamily("motor_degraded", "1 while health reports degraded (see "
                                    "/v1/health degraded[] for the causes)",
                                    value=float(r["status"] == "degraded"))
            troubled = GaugeMetricFamily("motor_degraded_subsystem",
                                         "1 for each subsystem health reports in trouble",
                                         labels=["subsystem"])
            for name in sorted({d.get("subsystem", "?") for d in r.get("degraded") or []}):
                troubled.add_metric([name], 1.0)
            yield troubled

        for key, name, doc in (("commits", "motor_store_commits", "write transactions of the job "
                                "store since start"),
                               ("slow_commits", "motor_store_slow_commits", "commits of the job "
                                "store that took 5 ms or more since start"),
                               ("commits_in_thread", "motor_store_commits_in_thread", "commits of "
                                "the job store run in a worker thread (the disk slow) since start"),
                               ("checkpoints", "motor_store_checkpoints", "WAL checkpoint rounds "
                                "of the job store since start (in a worker thread)")):
            if _num(store.get(key)) is not None:
                yield CounterMetricFamily(name, doc, value=float(store[key]))
        refusals = CounterMetricFamily(
            "motor_admission_refusals", "requests refused before acceptance since start, by code",
            labels=["code"])
        for code, n in sorted((r.get("admission_refusals") or {}).items()):
            refusals.add_metric([code], float(n))
        yield refusals

        finished = CounterMetricFamily(
            "motor_jobs_finished", "jobs that ended since start, by terminal state",
            labels=["state"])
        for state, n in sorted((r.get("finished") or {}).items()):
            finished.add_metric([state], float(n))
        yield finished

        repos = r.get("repositories") or {}
        reserved = GaugeMetricFamily(
            "motor_repository_reserved_vcpu_seconds_24h",
            "claim x wall seconds of jobs that ended in the rolling 24 h", labels=["repository"])
        jobs = GaugeMetricFamily(
            "motor_repository_finished_jobs_24h", "jobs that ran and ended in the rolling 24 h",
            labels=["repository"])
        by_vcpus = GaugeMetricFamily(
            "motor_repository_jobs_by_vcpus_24h", "finished jobs in the rolling 24 h by claim",
            labels=["repository", "vcpus"])
        qw = GaugeMetricFamily(
            "motor_repository_queue_wait_refusals_24h",
            "jobs refused for queue_wait_exceeded in the rolling 24 h", labels=["repository"])
        for repo, t in sorted(repos.items()):
            reserved.add_metric([repo], float(t.get("reserved_vcpu_seconds", 0)))
            jobs.add_metric([repo], float(t.get("finished_jobs", 0)))
            qw.add_metric([repo], float(t.get("queue_wait_refusals", 0)))
            for vcpus, n in sorted((t.get("jobs_by_vcpus") or {}).items(), key=lambda kv: int(kv[0])):
                by_vcpus.add_metric([repo, str(vcpus)], float(n))
        yield from (reserved, jobs, by_vcpus, qw)

        hourly = r.get("queue_wait_hourly") or []
        if hourly:
            current = hourly[-1]
            yield GaugeMetricFamily("motor_queue_wait_hour_started",
                                    "jobs started in the current hour", value=current["started"])
            yield GaugeMetricFamily("motor_queue_wait_hour_refusals",
                                    "queue-wait refusals in the current hour",
                                    value=current["refusals"])
            yield GaugeMetricFamily("motor_queue_wait_hour_p50_seconds",
                                    "nearest-rank p50 capacity wait of jobs started this hour",
                                    value=current["p50_ms"] / 1000)
            yield GaugeMetricFamily("motor_queue_wait_hour_p90_seconds",
                                    "nearest-rank p90 capacity wait of jobs started this hour",
                                    value=current["p90_ms"] / 1000)


class Metrics:
    """One registry and collector per runner; `render(report)` is the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = HealthCollector()
        self.registry.register(self.collector)

    def render(self, report: dict) -> bytes:
        self.collector.report = report  # no await between this and generate_latest
        try:
            return generate_latest(self.registry)
        finally:
            self.collector.report = {}
