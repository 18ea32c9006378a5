"""Admission and record building (motor/scheduling/admission.py): pure functions, unit and
Hypothesis tests. The same rules through the runner: tests/runner/test_runner_embedded.py,
tests/scheduling/test_dispatcher_actor.py."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from motor.config import RunnerConfig
from motor.lifecycle import QUEUED
from motor.memory.core import MemoryCeiling
from motor.records import JobRecord, JobRequest, RequestError, validate_request
from motor.scheduling.admission import (
    AdmissionSettings, accepted_events, build_record, check_capacity, check_form,
    disk_full_refusal, resume_clock, spec_of, withdraw_answer,
)
from motor.scheduling.core import Scheduler, claim_for, queue_wait_budget_s

SETTINGS = AdmissionSettings(claim_limit=8, capabilities=("gate_jobs",),
                             caller_roots={"/home/dev": "/srv/dev"}, per_vcpu_bytes=1 << 30,
                             default_spill_s=300.0, max_weight=8, max_queue_depth=4)


def core() -> Scheduler:
    return Scheduler(max_weight=8, max_queue_depth=4, claim_limit=8)


def test_settings_are_parsed_once_from_the_config():
    config = RunnerConfig(state_dir="/tmp/x", memory_per_vcpu_bytes="2G",
                          caller_root=["/home/dev=/srv/dev"], queue_wait_default_s=42.0,
                          max_weight=6, max_queue_depth=9)
    s = AdmissionSettings.from_config(config, claim_limit=6, capabilities=("gate_jobs",),
                                      floor_bytes=123)
    assert s.per_vcpu_bytes == 2 << 30 and s.caller_roots == {"/home/dev": "/srv/dev"}
    assert (s.default_spill_s, s.max_weight, s.max_queue_depth, s.floor_bytes) == (
        42.0, 6, 9, 123)


def test_malformed_requests_are_bad_requests():
    assert check_form(JobRequest(command=[]), SETTINGS).code == "bad_request"
    refusal = check_form(JobRequest(command=["make"], workspace="/elsewhere/app"), SETTINGS)
    assert refusal.code == "bad_request" and "--caller-root" in refusal.detail
    assert check_form(JobRequest(command=["make"], workspace="/home/dev/app"), SETTINGS) is None
    sib = JobRequest(command=["make"], workspace="app", siblings=["/other/lib"])
    assert check_form(sib, SETTINGS).code == "bad_request"


def test_capacity_refusals_name_the_claim_limit_and_the_memory_floor():
    claim, refusal = check_capacity(JobRequest(command=["make"], weight_hint=9), SETTINGS,
                                    core(), MemoryCeiling())
    assert claim == 9 and refusal.code == "runner_full" and "claim limit" in refusal.detail
    short = MemoryCeiling(declared_min_bytes=1)
    claim, refusal = check_capacity(JobRequest(command=["make"]), SETTINGS, core(), short)
    assert claim == 2 and refusal.code == "workspace_setup_failed"
    assert check_capacity(JobRequest(command=["make"]), SETTINGS, core(), MemoryCeiling()) == (
        2, None)


def test_disk_full_refusal_and_withdraw_answer():
    refusal = disk_full_refusal("database or disk is full", SETTINGS, 10)
    assert (refusal.code, refusal.free_bytes) == ("runner_disk_full", 10)
    ended = JobRecord(job_id="j", state="cancelled", workspace="w", reason="cancelled")
    answer = withdraw_answer(ended)
    assert answer.code == "already_ended" and "cancelled (cancelled)" in answer.detail
    ran = JobRecord(job_id="j", state="succeeded", workspace="w", started_at_ms=5)
    assert withdraw_answer(ran) == "started"


requests = st.builds(
    JobRequest,
    command=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3) | st.just([""]),
    workspace=st.sampled_from(["app", "a.b-c", "..", "/home/dev/x", "/nope/x", ""]),
    weight_hint=st.none() | st.integers(-2, 12),
    kind=st.sampled_from(["job", "warm_build", "cache_fill"]),
    gate=st.booleans(),
    capabilities=st.sampled_from([[], ["gate_jobs"]]),
    memory_max_bytes=st.none() | st.integers(-1, 1 << 36),
    queue_wait_limit_s=st.none() | st.floats(-1, 1e6) | st.just(float("nan")),
    spill_eligible=st.booleans(),
)


@settings(max_examples=300)
@given(req=requests, follow=st.booleans(),
       slice_max=st.none() | st.integers(1, 1 << 36), now_ms=st.integers(0, 1 << 45))
def test_admission_agrees_with_the_rules_it_composes(req, follow, slice_max, now_ms):
    try:
        validate_request(req)
        valid = True
    except RequestError:
        valid = False
    form = check_form(req, SETTINGS)
    if not valid:
        assert form is not None and form.code == "bad_request"
        return
    if form is not None:  # only the caller-root rule remains
        assert form.code == "bad_request" and req.workspace.startswith("/")
        return
    ceiling = MemoryCeiling(slice_max_bytes=slice_max)
    claim, refusal = check_capacity(req, SETTINGS, core(), ceiling)
    assert claim == claim_for(req.weight_hint, req.kind, SETTINGS.claim_limit)
    assert (refusal is not None) == (claim < 1 or claim > SETTINGS.claim_limit)
    record = build_record(req, job_id="j1", follow=follow, claim=claim, settings=SETTINGS,
                          ceiling=ceiling, now_ms=now_ms)
    assert record.state == QUEUED and record.claim == claim and record.job_id == "j1"
    assert record.accepted_at_ms == record.queued_at_ms == now_ms
    wanted = req.memory_max_bytes or claim * SETTINGS.per_vcpu_bytes
    assert record.memory_max_bytes == (wanted if slice_max is None else min(wanted, slice_max))
    assert record.gate == (req.gate and "gate_jobs" in req.capabilities)
    assert record.budget_enforced_by == ("client" if follow else "runner")
    spec = spec_of(record)
    assert (spec.job_id, spec.workspace, spec.claim, spec.kind) == (
        "j1", req.workspace, claim, req.kind)
    assert spec.runner_enforces_budget == (not follow)
    accepted, queued = accepted_events(record, SETTINGS)
    assert accepted.claim == claim and accepted.capabilities == ["gate_jobs"]
    assert queued.queue_wait_budget_ms == int(
        queue_wait_budget_s(spec, default_spill_s=SETTINGS.default_spill_s) * 1000)


@given(waited=st.integers(0, 10**7), at=st.integers(0, 10**9), later=st.integers(-10**6, 10**7),
       running=st.booleans(), ready_at=st.none() | st.integers(0, 10**9))
def test_a_recovered_clock_resumes_where_it_was_persisted(waited, at, later, running, ready_at):
    record = JobRecord(job_id="j", state=QUEUED, workspace="w", queue_wait_ms=waited,
                       queue_clock_at_ms=at, queue_clock_running=running, ready_at_ms=ready_at,
                       queued_at_ms=0)
    wall = at + later
    waited_s, age_s = resume_clock(record, wall)
    expect = waited + (max(0, later) if running else 0)
    assert waited_s == expect / 1000.0  # a paused clock does not move while the runner is down
    assert age_s == max(0, wall - (0 if ready_at is None else ready_at)) / 1000.0
