"""The task client's worker I/O (HTTP to the motor runners named in workers.toml): health
probes, submitting a turn as a runner job with its project bundle, the jobs listing a
re-attach searches, and cancelling accepted jobs.

A `Probe` is injectable (TaskClient(probe=...)): tests hand the runner health reports
instead of asking real workers.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

import trio

from motor.client import AsyncClient, RunnerUnavailable
from motor.records import JobRecord, JobRequest, RefusedError
from motor.tasks import host
from motor.tasks.records import TaskRecord
from motor.tasks.store import ClientDir
from motor.tasks.workers import Fleet, WorkerSpec

#: a worker's /v1/health report, or the error text when it does not answer
Probe = Callable[..., Awaitable["dict | str"]]

PROBE_TIMEOUT = 15.0


def worker_client(spec: WorkerSpec, timeout: float = 30.0) -> AsyncClient:
    return AsyncClient.for_endpoint(spec.endpoint, token=spec.token(), timeout=timeout)


async def probe_health(spec: WorkerSpec, timeout: float = 5.0) -> dict | str:
    """The worker's health report, or the error text when it does not answer."""
    try:
        with trio.fail_after(timeout):
            async with worker_client(spec, timeout=timeout) as client:
                return await client.health()
    except trio.TooSlowError:
        return f"no answer within {timeout:g} s"
    except (RunnerUnavailable, RefusedError, OSError) as exc:
        return str(exc)


async def observe(probe: Probe, specs: Iterable[WorkerSpec], reports: dict, errors: list) -> None:
    """Probe the workers concurrently: answers into `reports` (name -> health report),
    failures into `errors` (one line each)."""
    async def one(spec: WorkerSpec) -> None:
        rep = await probe(spec, timeout=PROBE_TIMEOUT)
        if isinstance(rep, dict):
            reports[spec.name] = rep
        else:
            errors.append(f"worker {spec.name} unreachable at {spec.endpoint}: {rep}")

    async with trio.open_nursery() as n:
        for spec in specs:
            n.start_soon(one, spec)


async def submit_turn(client: AsyncClient, cdir: ClientDir, task: TaskRecord, turn_id: str):
    """Upload the bundle of the task's worktree (`PUT /v1/bundles/{sha256}`) and submit the
    turn as a followed runner job in the task's workspace; the event stream."""
    bundle, sha = await trio.to_thread.run_sync(host.bundle_project, cdir, task)
    try:
        await client.put_bundle(sha, bundle)
    finally:
        await trio.to_thread.run_sync(lambda: bundle.unlink(missing_ok=True))
    turn = next(t for t in task.turns if t.turn_id == turn_id)
    req = JobRequest(command=turn.command, workspace=task.workspace, bundle_sha256=sha,
                     env={"MOTOR_TASK": task.task_id, "MOTOR_TURN": turn_id})
    return await client.submit(req, follow=True)


async def all_jobs(client: AsyncClient) -> list[JobRecord]:
    return await client.jobs(all=True)


async def cancel_jobs(fleet: Fleet, jobs: Iterable[tuple[str, str]]) -> None:
    """Cancel accepted jobs [(worker, job_id)] on their workers; a worker that is gone from
    workers.toml, refuses or does not answer is skipped (the turn's runner ends it)."""
    for worker, job_id in jobs:
        spec = fleet.get(worker)
        if spec is None:
            continue
        try:
            async with worker_client(spec) as client:
                await client.cancel(job_id)
        except (RefusedError, RunnerUnavailable):
            pass


__all__ = ["Probe", "PROBE_TIMEOUT", "worker_client", "probe_health", "observe", "submit_turn", "all_jobs",
           "cancel_jobs"]
