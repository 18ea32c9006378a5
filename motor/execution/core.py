"""The job execution actor's rules, pure: no trio, no I/O (the shell is execution/actor.py,
its blocking file work execution/jobdir.py).

Theory of operation
-------------------
The dispatcher has already placed the job's CPUs and saved the record in state `setup`.
The job's actor then sets the job up, spawns its keeper, follows `output.log` into the
store and turns `status.json` into the terminal record. What it decides, it asks here:

- `found`: what the job directory says about a keeper (docs/keeper.md, "Start protocol"):
  a claim (keeper.json) or an exit status means a keeper holds or held the job, which is
  adopted, never spawned again; neither means no keeper was ever released, and the job is
  set up (again), after killing strays of a start cut short.
- `job_env`, `job_spec`: the job's environment and the keeper's `spec.json`.
- `JobRun`: the job's phase (setup, spawning, following) and what a cancel does in each:
  before the keeper exists it is remembered (setup ends the job `cancelled` at its next
  checkpoint; a spawn in flight is cancelled once the keeper is known), afterwards the
  keeper is signalled.
- `after_start_error`: what a failed setup or spawn means (adopt a claimed directory, end
  `failed`/`spawn_failed`, or go back to the queue).
- `OutputDecoder`, `output_stopped`: output.log records to `output` events, batch by batch
  (an incremental UTF-8 decoder per stream, so a character split across records or batches
  is decoded whole), and what a log that cannot be parsed leaves in the terminal record.
- `terminal_record`: the keeper's status (or its absence) and the isolation backend's
  facts to the terminal record (motor/lifecycle.py `terminal_from_status`, reservation use).
"""

from __future__ import annotations

import codecs
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..accounting.core import with_reservation_use
from ..config import OUTPUT_POLL_S, parse_size
from ..lifecycle import CANCEL, REFUSE, SPAWN, advance, terminal_from_status
from ..records import JobRecord, Output
from . import joblog

__all__ = [
    "ADOPT", "CANCELLED", "DEFER", "FOLLOWING", "IGNORE", "KILL_GRACE_S", "READ_BATCH_BYTES",
    "REQUEUE", "SETUP", "SIGNAL", "SPAWNING", "SPAWN_FAILED", "Found", "JobRun",
    "OutputDecoder", "adopted", "after_start_error", "ended_in_setup", "found",
    "isolation_problems", "job_env", "job_spec", "output_stopped", "running_record",
    "spawn_failed_status", "terminal_record",
]

KILL_GRACE_S = 10.0  # the keeper's SIGTERM-to-SIGKILL grace on cancel and timeout
READ_BATCH_BYTES = joblog.READ_MAX_BYTES  # output.log bytes turned into events per store call

# phases of a job's actor
SETUP = "setup"  # before the spawn: disk check, workspace, isolation groups
SPAWNING = "spawning"  # the forkserver is asked for a keeper
FOLLOWING = "following"  # a keeper holds (or held) the job: output and exit

# what a cancel does
DEFER = "defer"  # remember it: setup stops at its next checkpoint / the keeper once known
SIGNAL = "signal"  # signal the keeper now
IGNORE = "ignore"  # nothing left to signal: the keeper has already exited

# outcomes of a failed start
ADOPT = "adopt"  # a keeper holds the job directory: follow it
SPAWN_FAILED = "spawn_failed"  # the keeper never started the job: it ends failed
REQUEUE = "requeue"  # nothing ran: back to the dispatcher's queue with the retry delay
CANCELLED = "cancelled"  # nothing ran and a cancel came meanwhile: it ends cancelled


# --- the job directory ----------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """What the job directory says when the actor starts (or restarts)."""

    adopt: bool  # a keeper holds or held the job: follow it, never spawn again
    keeper: tuple[int, float] | None = None  # (pid, create time) when a claim names it
    started_at_ms: int | None = None  # when the keeper started the job, if it said
    kill_strays: bool = False  # set up again over a start cut short: kill its leftovers first
    #: why the keeper's claim (keeper.json) could not be read, when it could not: the job is
    #: adopted without a keeper to follow, after its processes are stopped (`adopted`)
    claim_error: str | None = None


def found(keeper: Mapping[str, Any] | None, status_exists: bool, dir_exists: bool,
          claim_error: str | None = None, ran: bool = False) -> Found:
    """`keeper`: keeper.json's contents (None when absent); `status_exists`: status.json
    is there; `dir_exists`: the job directory is; `claim_error`: keeper.json is there but
    cannot be read (why); `ran`: the job's record says it was spawned (running).

    No claim and no status is a start cut short (keeperd writes the claim before it
    spawns), set up again; but not for a job recorded running, whose claim was lost after
    its spawn (removed by hand, or not yet on disk at a power cut): before stop 49 that job
    was spawned a second time beside the first's survivors. It is adopted with no keeper
    to follow, after its processes are stopped, as a claim that names none."""
    if claim_error is None and keeper is None and not status_exists and ran:
        claim_error = "keeper.json is missing, and the job was recorded running"
    if claim_error is not None:
        return Found(adopt=True, kill_strays=True, claim_error=claim_error)
    if keeper is None and not status_exists:
        return Found(adopt=False, kill_strays=dir_exists)
    return adopted(keeper or {})


def claimed_found(keeper: Mapping[str, Any] | None, claim_error: str | None = None) -> Found:
    """What a spawn refused as claimed finds: keeper.json's contents (`keeper`, None when
    absent) or why they cannot be read. A claim absent although the spawn was refused as
    claimed (keeperd still keeps the job) means the job directory was removed while the
    job ran, and the setup made it again (stop 60; before, the job ended `lost` saying its
    keeper "exited without recording an exit status"): its processes are stopped, as for a
    claim that names no keeper."""
    if keeper is None and claim_error is None:
        claim_error = ("keeper.json is missing, yet its keeper still keeps the job: the job "
                       "directory was removed while the job ran")
    return found(keeper or {}, True, True, claim_error)


def adopted(keeper: Mapping[str, Any]) -> Found:
    """Adopt the keeper a claim names (an empty claim: only its exit status is left). A claim
    that does not name a keeper as keepers write it (stop 48: a damaged keeper.json made
    the job's actor crash at every start until the runner stopped) cannot be followed: the
    job's processes are stopped (they carry its marker) and its end is what status.json
    says, if anything (`keeper_lost` otherwise)."""
    if not keeper:
        return Found(adopt=True)
    pid, create_time = keeper.get("keeper_pid"), keeper.get("keeper_create_time")
    started = keeper.get("started_at_ms")
    if not (type(pid) is int and type(create_time) in (int, float)
            and (started is None or type(started) is int)):
        return Found(adopt=True, kill_strays=True, claim_error=(
            f"keeper.json names no keeper (keeper_pid {pid!r}, keeper_create_time "
            f"{create_time!r}, started_at_ms {started!r})"))
    return Found(adopt=True, keeper=(pid, create_time), started_at_ms=started)


# --- setup ----------------------------------------------------------------------------------


def job_env(record: JobRecord, base: Mapping[str, str],
            compile_cache: str | None = None) -> dict[str, str]:
    """The job's environment: the runner's, the request's `env`, then the runner's own
    variables (which the request cannot override; MOTOR_JOB_ID is the job marker)."""
    env = dict(base)
    env.update(record.env)
    env["MOTOR_JOB_ID"] = record.job_id
    env["MOTOR_WORKSPACE"] = record.workspace
    env["MOTOR_VCPUS"] = str(record.claim)
    if compile_cache:
        env["MOTOR_COMPILE_CACHE"] = compile_cache
    if record.cpus:
        env["MOTOR_CPUS"] = ",".join(map(str, record.cpus))
    return env


def job_spec(record: JobRecord, cwd: str, env: Mapping[str, str], umask: int,
             isolation: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The keeper's spec.json: the command and its place, and the isolation backend's fields
    (cgroup paths, limits), which come last."""
    return {
        "job_id": record.job_id,
        "command": record.command,
        "cwd": cwd,
        "env": dict(env),
        "cpus": record.cpus,
        "timeout_s": record.timeout_s,
        "kill_grace_s": KILL_GRACE_S,
        "umask": umask,  # the operator's; the runner's own is 077
        **isolation,
    }


def after_start_error(error: str, claim_on_disk: bool, cancel_requested: bool = False) -> str:
    """What a failed setup or spawn means. `error`: "claimed" (JobDirClaimed: another
    keeper holds the directory), "not_started" (KeeperNotStarted: the keeper's identity is
    not durable), "spawner" (SpawnerError: the forkserver failed mid-request) or anything
    else (the workspace, the isolation backend, spec.json); `claim_on_disk`: keeper.json
    exists. A claim on disk means a keeper may run the job: adopt it, never spawn again
    (a pending cancel then signals it). Otherwise nothing ran: the job goes back to its
    queue, unless a cancel came meanwhile (during the spawn), which it ends `cancelled`."""
    if error == "claimed" or (error == "spawner" and claim_on_disk):
        return ADOPT
    if error == "not_started":
        return SPAWN_FAILED
    return CANCELLED if cancel_requested else REQUEUE


def spawn_failed_status(detail: str) -> dict[str, Any]:
    """The status a keeper that never started the job leaves (ends failed/spawn_failed)."""
    return {"exit_code": None, "signal": None, "reason": "spawn_failed", "detail": detail,
            "started_at_ms": None, "ended_at_ms": None}


def ended_in_setup(record: JobRecord, refusal: Any, now_ms: int,
                   who: str | None = None) -> JobRecord:
    """The job ends before its keeper was spawned, never started: `refused_before_start`
    with the `refusal`'s code (e.g. runner_disk_full at the setup check, a bad bundle), or
    `cancelled` (refusal None: a cancel arrived during setup)."""
    if refusal is None:
        return advance(record, CANCEL, who=who, reason="cancelled",
                       detail="cancelled during setup", ended_at_ms=now_ms, waiting_on=None,
                       waiting_on_job=None)
    return advance(record, REFUSE, who=who, reason=refusal.code, detail=refusal.detail,
                   ended_at_ms=now_ms, waiting_on=None, waiting_on_job=None)


def running_record(record: JobRecord, started_at_ms: int | None, now_ms: int,
                   who: str | None = None) -> JobRecord:
    """A keeper holds the job: `running` since the keeper's start time (or now)."""
    return advance(record, SPAWN, who=who, started_at_ms=started_at_ms or now_ms,
                   waiting_on=None, waiting_on_job=None)


class JobRun:
    """One job's execution as its actor's decisions see it: the record, the phase, the
    keeper once known, a cancel not yet carried out, and the output decoder."""

    def __init__(self, record: JobRecord, cancel_requested: bool = False, config: Any = None,
                 job_dir: Any = None):
        """`cancel_requested`: a cancel told before this run's actor existed (a restart);
        `config`: the runner's (its output cap: `OutputDecoder.keep_bytes`; its output
        poll); `job_dir`: where its output.log is (`jobdir.relieve`)."""
        self.record, self.job_dir = record, job_dir
        self.phase = SETUP
        self.keeper: tuple[int, float] | None = None
        self.cancel_requested = cancel_requested
        self.output = OutputDecoder(None if config is None else
                                    parse_size(config.max_output_bytes_per_job))
        #: seconds between output reads while the job runs (RunnerConfig.output_poll_s)
        self.poll_s = OUTPUT_POLL_S if config is None else config.output_poll_s
        #: events not saved yet, and the log offset after them: they go with the job's next
        #: write (`defer`), a commit less each (docs/keeper.md, "The start's record goes
        #: with the job's next write")
        self.unsaved: list = []
        self.unsaved_offset: int | None = None

    def defer(self, events: list, log_offset: int | None = None) -> None:
        """Save `events` (and the log offset after them) with the job's next write: a fresh
        start's Started event (a crash meanwhile leaves the record in setup and keeper.json
        naming the job's keeper: a start adoption resumes), the last output batch read
        after the job's exit (with the terminal record; a crash meanwhile reads it again
        from output.log, from the offset saved before it)."""
        self.unsaved += events
        if log_offset is not None:
            self.unsaved_offset = log_offset

    def with_unsaved(self, events=(), log_offset: int | None = None) -> tuple[list, int | None]:
        """The events and log offset of a write, with what waits for it (then gone): the
        deferred events first, the write's own offset over the deferred one."""
        if not self.unsaved:
            return list(events), log_offset
        merged, self.unsaved = [*self.unsaved, *events], []
        offset = self.unsaved_offset if log_offset is None else log_offset
        self.unsaved_offset = None
        return merged, offset

    def cancel(self) -> str:
        """A cancel arrived: DEFER (no keeper yet), SIGNAL (signal the keeper now) or IGNORE
        (following a job whose keeper had exited: only its status is left)."""
        self.cancel_requested = True
        if self.keeper is not None:
            return SIGNAL
        return IGNORE if self.phase == FOLLOWING else DEFER

    def setup_cancelled(self) -> bool:
        """At a setup checkpoint: stop here, the job ends cancelled without a start."""
        return self.phase == SETUP and self.cancel_requested

    def spawning(self) -> None:
        self.phase = SPAWNING

    def follow(self, keeper: tuple[int, float] | None) -> None:
        """A keeper holds the job (spawned or adopted; None: it exited before the runner
        saw it)."""
        self.phase, self.keeper = FOLLOWING, keeper

    def cancel_due(self) -> bool:
        """Once following: a cancel that arrived before the keeper was known is due now."""
        return self.cancel_requested and self.keeper is not None


# --- output -----------------------------------------------------------------------------------


def _output(stream: str, text: str, data: bytes, decoder: Any) -> Output:
    """The event of `text`, decoded from `data` less what `decoder` still holds: with the
    exact bytes (`data_b64`) where they are not valid UTF-8, so that a client can write out
    what the job wrote (stop 58: `motor run -- cat some.tar > copy` was not a
    copy). Text without U+FFFD, nearly all output, is not looked at again."""
    if "\ufffd" not in text:
        return Output(stream=stream, data=text)
    if held := decoder.getstate()[0]:
        data = data[:-len(held)]
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return Output(stream=stream, data=text, data_b64=b64encode(data).decode("ascii"))
    return Output(stream=stream, data=text)  # U+FFFD the job wrote itself


class OutputDecoder:
    """output.log records to `output` events, one incremental UTF-8 decoder per stream
    (invalid bytes become U+FFFD in `data`, and the event carries the exact bytes in
    `data_b64`; a character split across records stays whole). Once the
    log could not be parsed, `error` says where and why, and no more output is read."""

    def __init__(self, keep_bytes: int | None = None) -> None:
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace")
                          for s in ("stdout", "stderr")}
        self.error: str | None = None
        #: the job's output cap (--max-output-bytes-per-job): output.log not read yet past
        #: this much is skipped to its last this-much (`jobdir.read_output`); None: never
        self.keep_bytes = keep_bytes
        #: (from, to): output.log skipped there already, its hole punched while the store
        #: waited for space (`jobdir.relieve`); the read from `from` goes on at `to`
        self.pending_skip: tuple[int, int] | None = None

    def skipped(self, count: int) -> Output:
        """The note in place of `count` bytes of output.log skipped unread: the store would
        have kept none of them (the cap counts stored bytes, at least the log's)."""
        for decoder in self._decoders.values():
            decoder.reset()
        return Output(stream="stderr", data=(
            f"motor: {count} bytes of output were skipped: the job printed them faster than "
            f"the runner stores output, and more than the runner keeps of a job's output "
            f"({self.keep_bytes} bytes) came after them\n"))

    def events(self, records: Sequence[tuple[str, bytes]]) -> list[Output]:
        out = []
        for stream, data in records:
            decoder = self._decoders[stream]
            held = decoder.getstate()[0]  # a character's first bytes, from the record before
            if text := decoder.decode(data):
                out.append(_output(stream, text, held + data, decoder))
        return out

    def tail(self) -> list[Output]:
        """At the job's end: the bytes each decoder still holds (a character cut short by
        the end of the output), as events; before stop 58 they were dropped."""
        out = []
        for stream, decoder in self._decoders.items():
            held = decoder.getstate()[0]
            if text := decoder.decode(b"", final=True):
                out.append(_output(stream, text, held, decoder))
        return out

    def stopped(self, offset: int, exc: BaseException) -> str:
        """The log cannot be read past `offset`: output ends at the last good record."""
        self.error = output_stopped(offset, exc)
        return self.error


def output_stopped(offset: int, exc: BaseException) -> str:
    return f"output stopped at byte {offset} of output.log: {exc}"


# --- the end ----------------------------------------------------------------------------------


def terminal_record(record: JobRecord, status: dict | None, now_ms: int, facts: dict,
                    output_error: str | None = None,
                    status_unreadable: str | None = None,
                    claim_error: str | None = None) -> JobRecord:
    """The terminal record from the keeper's status (None: the keeper was lost; with
    `status_unreadable`, why it could not be read: `jobdir.read_status`) and the isolation
    backend's `facts`: the group's CPU time covers the whole process tree and replaces the
    keeper's figure. Why the runner stopped the job's processes when it adopted it
    (`claim_error`: its keeper's claim named no keeper to follow; before stop 59 such a job
    ended `failed` by signal 9 with no word of why but the log's) and a reason output
    stopped early join the detail."""
    if status is not None and facts.get("cpu_time_ms") is not None:
        status = {**status, "cpu_time_ms": facts["cpu_time_ms"]}
    ended = terminal_from_status(record, status, now_ms, facts, status_unreadable)
    ended = with_reservation_use(ended, status)  # unchanged when unmeasured
    stopped = claim_error and (f"the runner stopped the job's processes when it adopted the "
                               f"job: its keeper's claim names no keeper ({claim_error})")
    if stopped or output_error is not None:
        ended = msgspec.structs.replace(ended, detail="; ".join(
            d for d in (ended.detail, stopped, output_error) if d))
    return ended


def isolation_problems(facts: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """What the isolation backend could not do at the end (logged, never fatal)."""
    return [(p, facts[p]) for p in ("collect_error", "cleanup_error") if facts.get(p)]


def ended_line(name: str, record: Any) -> str:
    """The log line of a job's end: `job-ID: failed (exit 3)`, with the detail or reason
    when there is one (`motor serve --log-level info`)."""
    how = ", ".join(part for part in (
        record.exit_code is not None and f"exit {record.exit_code}",
        record.signal and f"signal {record.signal}") if part)
    why = record.detail or record.reason
    return f"{name}: {record.state}" + (f" ({how})" if how else "") + (f": {why}" if why else "")
