"""A fake Runner (the facade `motor.runner.Runner`, in memory) for API and CLI tests.

Jobs live in memory; each job's events come from a script (an async function that calls
`job.emit(event)` and `job.finish(state=..., ...)`).  With a nursery the script runs in the
background (it may sleep or wait for a withdraw); without one it runs inside `submit`.
"""

from __future__ import annotations

import contextlib

from typing import Awaitable, Callable

import msgspec
import trio

from motor.config import RunnerConfig
from motor.records import (
    CAPABILITIES,
    Accepted,
    Event,
    JobRecord,
    JobRequest,
    Output,
    Queued,
    Refusal,
    RefusedError,
    RequestError,
    Started,
    Terminal,
    public_record,
    validate_request,
)
from motor.scheduling.view import row_of


class FakeJob:
    def __init__(self, record: JobRecord, req: JobRequest):
        self.record = record
        self.req = req
        self.log: list[Event] = []
        self.changed = trio.Event()
        self.withdrawn = trio.Event()
        self.cancelled = trio.Event()

    @property
    def id(self) -> str:
        return self.record.job_id

    def emit(self, event: Event) -> None:
        self.log.append(msgspec.structs.replace(event, seq=len(self.log)))
        self.changed.set()
        self.changed = trio.Event()

    def update(self, **fields) -> None:
        self.record = msgspec.structs.replace(self.record, **fields)

    def finish(self, **fields) -> None:
        if self.record.terminal:
            return
        self.update(**fields)
        self.emit(Terminal(record=public_record(self.record)))


Script = Callable[[FakeJob], Awaitable[None]]


async def default_script(job: FakeJob) -> None:
    job.emit(Queued(queue_wait_ms=0, queue_wait_budget_ms=60_000))
    job.update(state="running", cpus=[0, 1])
    job.emit(Started(cpus=[0, 1]))
    job.emit(Output(stream="stdout", data="hello\n"))
    job.emit(Output(stream="stderr", data="warning: é\n"))
    job.finish(state="succeeded", exit_code=0)


def exits(code: int | None = None, *, signal: int | None = None, state: str | None = None,
          reason: str | None = None, detail: str | None = None) -> Script:
    async def script(job: FakeJob) -> None:
        job.emit(Started(cpus=[0]))
        job.emit(Output(stream="stdout", data="out\n"))
        final = state or ("succeeded" if code == 0 and signal is None else "failed")
        job.finish(state=final, exit_code=code, signal=signal, reason=reason, detail=detail)
    return script


async def queue_then_withdraw(job: FakeJob) -> None:
    """Queued heartbeats with a 300 ms budget until withdrawn, then refused_before_start."""
    waited = 0
    while not job.withdrawn.is_set():
        job.emit(Queued(queue_wait_ms=waited, waiting_on="permits", queue_wait_budget_ms=300))
        with trio.move_on_after(0.05):
            await job.withdrawn.wait()
        waited += 50
    job.finish(state="refused_before_start", reason="queue_wait_exceeded",
               detail="not started within the queue wait limit of 0.3s")


async def wait_for_cancel(job: FakeJob) -> None:
    job.update(state="running", cpus=[0])
    job.emit(Started(cpus=[0]))
    job.emit(Output(stream="stdout", data="working\n"))
    await job.cancelled.wait()
    job.finish(state="cancelled")


class FakeRunner:
    def __init__(self, config: RunnerConfig | None = None, nursery: trio.Nursery | None = None):
        self.config = config or RunnerConfig(state_dir="/nonexistent/motor-test")
        self.capabilities = CAPABILITIES
        self.nursery = nursery
        self.jobs_by_id: dict[str, FakeJob] = {}
        self.submitted: list[tuple[JobRequest, bool]] = []
        self.refusal: Refusal | None = None
        self.script: Script = default_script
        self.expired: set[str] = set()
        self.withdraw_result = "withdrawn"
        self.explode = False
        self.jobs_calls: list[bool] = []
        self.unfollowed: list[str] = []

    # -- facade ------------------------------------------------------------------------------

    async def submit(self, req: JobRequest, *, follow: bool = False) -> JobRecord:
        try:
            validate_request(req)
        except RequestError as exc:
            raise RefusedError(Refusal(code="bad_request", detail=str(exc))) from None
        if self.refusal is not None:
            raise RefusedError(self.refusal)
        self.submitted.append((req, follow))
        job_id = f"0190000{len(self.jobs_by_id):05d}"
        record = JobRecord(job_id=job_id, state="queued", workspace=req.workspace, command=req.command,
                           claim=req.weight_hint or 2, follow=follow, env=req.env,
                           accepted_at_ms=1_700_000_000_000)
        job = FakeJob(record, req)
        self.jobs_by_id[job_id] = job
        job.emit(Accepted(job_id=job_id, claim=record.claim, capabilities=list(self.capabilities)))
        if self.nursery is not None:
            self.nursery.start_soon(self.script, job)
        else:
            await self.script(job)
        return job.record

    def _job(self, job_id: str) -> FakeJob:
        if job_id in self.expired:
            raise RefusedError(Refusal(code="history_expired", detail=f"job {job_id} is past retention"))
        try:
            return self.jobs_by_id[job_id]
        except KeyError:
            raise RefusedError(Refusal(code="not_found", detail=f"no job {job_id}")) from None

    async def get(self, job_id: str) -> JobRecord:
        return self._job(job_id).record

    async def jobs(self, *, all: bool = False) -> list[JobRecord]:
        self.jobs_calls.append(all)
        return [j.record for j in self.jobs_by_id.values()]

    async def events(self, job_id: str, from_seq: int = 0):
        job = self._job(job_id)
        i = 0
        while True:
            while i < len(job.log):
                event = job.log[i]
                i += 1
                if event.seq >= from_seq:
                    yield event
                if isinstance(event, Terminal):
                    return
            await job.changed.wait()

    async def follow(self, job_id: str):
        """The submitting client's stream; records when it went away early."""
        ended = False
        try:
            async with contextlib.aclosing(self.events(job_id, 0)) as events:
                async for event in events:
                    ended = isinstance(event, Terminal)
                    yield event
        finally:
            if not ended:
                self.unfollowed.append(job_id)

    async def cancel(self, job_id: str) -> JobRecord:
        job = self._job(job_id)
        job.cancelled.set()
        if self.nursery is None:
            job.finish(state="cancelled")
        else:
            await trio.sleep(0.01)
        return job.record

    async def withdraw(self, job_id: str) -> str:
        job = self._job(job_id)
        job.withdrawn.set()
        return self.withdraw_result

    async def status(self, full: bool = False) -> dict:
        records = [j.record for j in self.jobs_by_id.values() if not j.record.terminal]
        live = [public_record(r) if full else row_of(r) for r in records]
        return {
            "queued": [r for r in live if r["state"] == "queued"],
            "running": [r for r in live if r["state"] != "queued"],
            "capacity": {"max_weight": 8, "held_permits": 0},
        }

    async def status_json(self, full: bool = False) -> bytes:
        return msgspec.json.encode(await self.status(full)) + b"\n"

    async def health(self) -> dict:
        if self.explode:
            raise RuntimeError("kaboom")
        return {
            "isolation": "none",
            "capacity": {"max_weight": 8, "claim_limit": 8, "held_permits": 0, "setup_permits": 0,
                         "max_queue_depth": 64, "pending_jobs": 0},
            "disk": {"free_bytes": 10 * 1024**3, "floor_bytes": 1024**3, "goal_bytes": 2 * 1024**3},
            "admission_refusals": {},
            "underused": [],
            "repositories": {"app": {"reserved_vcpu_seconds": 10, "finished_jobs": 1}},
            "queue_wait_hourly": [{"hour_start_ms": 0, "started": 1, "p50_ms": 5, "p90_ms": 9, "refusals": 0}],
        }

    async def workspaces(self) -> list[dict]:
        return [{"name": "default", "kind": "task", "size_bytes": 12345, "idle_ms": 61_000, "protected": False}]

    def metrics_text(self) -> bytes:
        return b"# HELP motor_jobs_total jobs\n# TYPE motor_jobs_total counter\nmotor_jobs_total 0\n"
