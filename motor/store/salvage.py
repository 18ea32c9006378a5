"""Reading a stored job record that this version's `JobRecord` does not decode.

A record row can hold what this runner cannot read: a value another version of motor
wrote (a `kind` or `waiting_on` it does not know), one an embedder's unchecked request
put there before requests were type-checked (stop 48), or a row damaged on disk. Before,
one such row made every read of the job raise msgspec's error and stopped the runner at
start-up (the actors that read the live records at recovery crashed until their
supervisors gave up). Now (docs/operations.md, "A record the runner cannot read"):

- a field that only describes the job or its wait (anything but `_ESSENTIAL`) is read with
  its default, and the runner says so once per job in its log;
- a record whose essential fields (what runs, where, on how much, in which state) cannot
  be read, or that is not JSON at all, is read as a `lost` record (`reason`
  `record_unreadable`, `detail` quoting the decoder) that the runner neither queues nor
  adopts: it runs nothing it cannot read, and says what it set aside (a job recorded
  running has its processes stopped at start-up: `Database.active_unreadable`,
  runner/tree.py).
"""

from __future__ import annotations

import logging
import re

import msgspec

from ..records import JobRecord

log = logging.getLogger("motor.store")

#: a record that cannot be read whole is `lost` with this reason
UNREADABLE = "record_unreadable"
#: the fields that say what runs, where, on how much, and in which state: not guessed
_ESSENTIAL = frozenset({
    "job_id", "state", "workspace", "siblings", "command", "claim", "cpus", "env",
    "memory_max_bytes", "timeout_s", "bundle_sha256",
})
_FIELD = re.compile(r"- at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
#: what was already reported in this process (each read of a broken row would say it again)
_told: set[tuple] = set()
_TOLD_MAX = 4096


def salvage(raw: bytes, job_id: str, state: str, error: Exception) -> JobRecord:
    """The record in `raw` (its row's `job_id` and `state` columns beside it), read as far as
    `_ESSENTIAL` allows; `error`: what the strict decoder said."""
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        data["job_id"] = job_id  # the row's key is the job's identity
        dropped: list[str] = []
        for _ in range(len(data)):
            try:
                record = msgspec.convert(data, JobRecord)
            except msgspec.ValidationError as exc:
                match = _FIELD.search(str(exc))
                name = match.group(1) if match else None
                if name is None or name in _ESSENTIAL or name not in data:
                    error = exc
                    break
                dropped.append(f"{name}={data.pop(name)!r}")
                continue
            tell_once(("record", job_id), "job %s: its stored record has values this runner "
                      "cannot read (%s): read with their defaults", job_id, ", ".join(dropped))
            return record
    detail = f"its stored record could not be read ({error}); the runner set it aside"
    tell_once(("record", job_id), "job %s: %s", job_id, detail)
    return JobRecord(job_id=job_id, state="lost", workspace="", reason=UNREADABLE,
                     detail=f"{detail} (its row's state: {state})")


def unreadable(record: JobRecord) -> bool:
    """A record `salvage` could not read: no job of this runner's to queue or adopt."""
    return record.reason == UNREADABLE and record.state == "lost"


def tell_once(key: tuple, *args) -> None:
    """`log.warning(*args)`, once per `key` in this process (a bounded memory)."""
    if key in _told:
        return
    if len(_told) >= _TOLD_MAX:
        _told.clear()
    _told.add(key)
    log.warning(*args)
