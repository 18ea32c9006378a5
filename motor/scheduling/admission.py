"""Admission and record building: pure functions the dispatcher's state machine decides with.

No trio, no I/O: the settings are parsed once (sizes, caller roots) when the dispatcher is
made, and every function here takes plain data and returns plain data.

Admission of one request, in order (the first refusal wins, nothing is recorded for it):

1. `check_form`: the request's form (`validate_request`, run here and only here), and
   workspaces given as absolute paths need a `--caller-root` serving them; then
   `check_capacity`: the claim (`claim_for`) within the claim limit
   (`Scheduler.check_claim`), and the host's declared memory floor (`memory.core.admission`).
2. the disk (its cleanup protects the job's workspace and siblings from then on): asked by
   the dispatcher's shell, answered as a message (machine.py).
3. `build_record` + `Scheduler.accept` (max_queue_depth), then the store records it with
   `accepted_events`; a store refusal for lack of space is `disk_full_refusal`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..config import parse_size
from ..lifecycle import QUEUED
from ..memory.core import MemoryCeiling, admission as memory_admission, unit_limit
from ..records import (
    IDEMPOTENT_FIELDS, Accepted, JobRecord, JobRequest, Queued, Refusal, RequestError,
    caller_root_for, validate_request,
)
from .core import JobSpec, Scheduler, claim_for, gate_honoured, queue_wait_budget_s


@dataclass(frozen=True)
class AdmissionSettings:
    """What admission needs from the configuration, parsed once."""

    claim_limit: int
    capabilities: tuple[str, ...] = ()
    caller_roots: Mapping[str, str] = field(default_factory=dict)  # {caller prefix: host dir}
    per_vcpu_bytes: int = 4 << 30  # a claim's default memory_max
    default_spill_s: float = 300.0  # queue_wait_default_s
    max_weight: int = 0
    max_queue_depth: int = 0
    floor_bytes: int | None = None  # the free-space floor, reported with runner_disk_full

    @classmethod
    def from_config(cls, config, *, claim_limit: int, capabilities: tuple[str, ...],
                    floor_bytes: int | None = None) -> "AdmissionSettings":
        return cls(
            claim_limit=claim_limit, capabilities=tuple(capabilities),
            caller_roots=dict(config.caller_roots),
            per_vcpu_bytes=parse_size(config.memory_per_vcpu_bytes),
            default_spill_s=config.queue_wait_default_s, max_weight=config.max_weight,
            max_queue_depth=config.max_queue_depth, floor_bytes=floor_bytes)


def as_refusal(refusal) -> Refusal:
    """Any refusal-like object (code, detail) as a records.Refusal."""
    if isinstance(refusal, Refusal):
        return refusal
    return Refusal(code=refusal.code, detail=refusal.detail)


def check_form(req: JobRequest, settings: AdmissionSettings) -> Refusal | None:
    """A `bad_request` refusal for a malformed request (not an admission decision: it is
    not counted in health's admission_refusals), else None."""
    try:
        validate_request(req)
    except RequestError as exc:
        return Refusal(code="bad_request", detail=str(exc))
    for name in (req.workspace, *req.siblings):
        if name.startswith("/") and caller_root_for(name, settings.caller_roots) is None:
            return Refusal(code="bad_request", detail=(
                f"workspace {name!r} is not a plain name and no --caller-root serves it"))
    return None


def check_capacity(req: JobRequest, settings: AdmissionSettings, core: Scheduler,
                   ceiling: MemoryCeiling) -> tuple[int, Refusal | None]:
    """(the job's claim, a refusal or None) of a well-formed request, before the disk is
    asked: the claim within the claim limit, the host's declared memory floor."""
    claim = claim_for(req.weight_hint, req.kind, settings.claim_limit)
    refusal = core.check_claim(claim) or memory_admission(ceiling)
    return claim, None if refusal is None else as_refusal(refusal)


def build_record(req: JobRequest, *, job_id: str, follow: bool, claim: int,
                 settings: AdmissionSettings, ceiling: MemoryCeiling, now_ms: int) -> JobRecord:
    """The queued record of an admitted request, accepted at `now_ms`."""
    gate = gate_honoured(req.gate, req.capabilities) and "gate_jobs" in settings.capabilities
    return JobRecord(
        job_id=job_id, state=QUEUED, workspace=req.workspace,
        workspace_kind=req.workspace_kind, siblings=list(req.siblings),
        repository=req.repository, command=list(req.command), kind=req.kind, gate=gate,
        claim=claim,
        memory_max_bytes=unit_limit(req.memory_max_bytes or claim * settings.per_vcpu_bytes,
                                    ceiling),
        accepted_at_ms=now_ms, queued_at_ms=now_ms, timeout_s=req.timeout_s,
        queue_wait_limit_s=req.queue_wait_limit_s, spill_eligible=req.spill_eligible,
        follow=follow, env=dict(req.env), bundle_sha256=req.bundle_sha256,
        budget_enforced_by="client" if follow else "runner", idempotency_key=req.idempotency_key,
    )


def same_submit(req: JobRequest, first: JobRequest | JobRecord) -> bool:
    """Whether `req` asks for what `first` (the request, or the record of the job, accepted
    with the same idempotency key) asked for: the fields IDEMPOTENT_FIELDS names."""
    return all(getattr(req, name) == getattr(first, name) for name in IDEMPOTENT_FIELDS)


def key_reused(key: str, job_id: str) -> Refusal:
    return Refusal(code="idempotency_key_reused", detail=(
        f"idempotency key {key!r} was used for job {job_id}, which asked for something else "
        f"(one of: {', '.join(IDEMPOTENT_FIELDS)}); use a new key for a new job"))


def spec_of(record: JobRecord) -> JobSpec:
    """The scheduling core's view of a job record."""
    enforcer = record.budget_enforced_by or ("client" if record.follow else "runner")
    return JobSpec(
        job_id=record.job_id, workspace=record.workspace, siblings=tuple(record.siblings),
        claim=record.claim, gate=record.gate, kind=record.kind,
        queue_wait_limit_s=record.queue_wait_limit_s, timeout_s=record.timeout_s,
        spill_eligible=record.spill_eligible, runner_enforces_budget=enforcer == "runner",
    )


def budget_ms(record: JobRecord, settings: AdmissionSettings) -> int:
    return int(queue_wait_budget_s(spec_of(record), default_spill_s=settings.default_spill_s)
               * 1000)


def accepted_events(record: JobRecord, settings: AdmissionSettings) -> list:
    """The events recorded with an accepted job: `accepted` and its first `queued`."""
    return [Accepted(job_id=record.job_id, claim=record.claim,
                     capabilities=list(settings.capabilities)),
            Queued(queue_wait_budget_ms=budget_ms(record, settings))]


def disk_full_refusal(detail: str, settings: AdmissionSettings,
                      free_bytes: int | None) -> Refusal:
    """`runner_disk_full` for a job the store could not record (the state fs is full)."""
    return Refusal(code="runner_disk_full", detail=detail, free_bytes=free_bytes,
                   floor_bytes=settings.floor_bytes)


def withdraw_answer(record: JobRecord) -> str | Refusal:
    """The answer to withdrawing a job that already ended: "started" if it ran (too late),
    else an `already_ended` refusal naming its state (never "withdrawn" a second time)."""
    if record.started_at_ms is not None:
        return "started"
    return Refusal(code="already_ended", job_id=record.job_id, detail=(
        f"job {record.job_id} already ended before it started: {record.state}"
        + (f" ({record.reason})" if record.reason else "")))


def resume_clock(record: JobRecord, wall_ms: int) -> tuple[float, float]:
    """(queue wait so far, seconds since ready) of a queued job recovered after a restart,
    from its persisted clock. A clock that was advancing kept advancing while the runner
    was down (that wait was not for a workspace); a paused one resumes at its value.
    Records from before these fields resume at their stored queue_wait_ms."""
    waited_ms = record.queue_wait_ms
    if record.queue_clock_running and record.queue_clock_at_ms is not None:
        waited_ms += max(0, wall_ms - record.queue_clock_at_ms)
    ready_at = record.ready_at_ms
    if ready_at is None and record.bundle_sha256 is None:
        ready_at = record.queued_at_ms
    age_ms = 0 if ready_at is None else max(0, wall_ms - ready_at)
    return waited_ms / 1000.0, age_ms / 1000.0
