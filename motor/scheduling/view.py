"""The queued part of the status view, as JSON bytes, each record encoded once (issue 14).

`GET /v1/status` with 10,000 queued jobs answers about 6 MB of full public records. Of each
record only the live wait fields (`queue_wait_ms`, `waiting_on`, `waiting_on_job`,
`waiting_detail`) change between two views while the record stays the same; the rest of its
public form is encoded once and kept as two byte strings, the part before `queue_wait_ms` and
the part from `exit_code` on. A view then encodes only the live fields of each job and splices
them between its two parts.

A cached entry holds the record it was encoded from and is used only while the dispatcher
still holds that same record object (`is`): every change to a queued record (a clock save,
a requeue after a failed start, a new budget enforcer) replaces the object
(`msgspec.structs.replace`, `lifecycle.advance`), never mutates it, so a replaced record is
encoded again at the next view. The entry's reference keeps the old object alive, so its
identity cannot be reused by another record. Entries of jobs no longer queued (started,
cancelled, withdrawn) are dropped at the next view.

Pure: no trio, no actors (the dispatcher's machine owns one `QueuedJson`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from ..records import _INTERNAL_FIELDS, JobRecord

#: record fields the API never shows (records.public_record), reservation_use when unmeasured
WITHHELD = ("env", "reservation_use", *_INTERNAL_FIELDS)

_encode = msgspec.json.Encoder().encode

# The live fields, with placeholder values, as they sit in an encoded public record: found
# once per record to cut it in two. `,"` never occurs inside an encoded JSON string (a quote
# in a string is always escaped) and no field before them holds an object with keys of its
# own, so the first occurrence is the record's own fields.
_MARK_HEAD = b',"queue_wait_ms":'
_MARK = _MARK_HEAD + b'0,"waiting_on":null,"waiting_on_job":null'
_MARK_NEXT = b',"exit_code":'


def public_form(record: JobRecord, waiting_on: str | None, waiting_on_job: str | None,
                queue_wait_ms: int, waiting_detail: str | None) -> dict:
    """`records.public_record` of the record with these live wait fields, built cheaply: a
    queued record holds only plain values (its reservation_use is unmeasured), so a shallow
    asdict is its public form once the withheld fields are dropped. Keys in field order."""
    if record.reservation_use is not None:
        data = msgspec.to_builtins(record)
        del data["env"]
        for name in _INTERNAL_FIELDS:
            del data[name]
    else:
        data = msgspec.structs.asdict(record)
        for name in WITHHELD:
            del data[name]
    data["queue_wait_ms"] = queue_wait_ms
    data["waiting_on"] = waiting_on
    data["waiting_on_job"] = waiting_on_job
    if waiting_detail is None:
        del data["waiting_detail"]
    else:
        data["waiting_detail"] = waiting_detail
    return data


def encoded_parts(record: JobRecord) -> tuple[bytes, bytes]:
    """(the encoded public record up to and including `"queue_wait_ms":`, the rest from
    `,"exit_code":` to the closing brace): the record's public form without its live fields."""
    raw = _encode(public_form(record, None, None, 0, None))
    at = raw.find(_MARK + _MARK_NEXT)
    if at < 0:  # JobRecord's field order changed: the live fields are no longer together
        raise ValueError("status view: the live wait fields of a record are not adjacent")
    return raw[:at + len(_MARK_HEAD)], raw[at + len(_MARK):]


class QueuedJson:
    """The encoded public records of the queued jobs, kept across views (see the module)."""

    def __init__(self) -> None:
        #: {job_id: (the record encoded, head bytes, tail bytes)}
        self._parts: dict[str, tuple[JobRecord, bytes, bytes]] = {}
        #: records encoded by the last view (fresh or replaced since the one before)
        self.encoded_last = 0

    def __len__(self) -> int:
        return len(self._parts)

    def carry(self, old: JobRecord, new: JobRecord) -> None:
        """`new` replaces `old` with only its clock changed (`queue_wait_ms`, a live field,
        and the internal clock fields, none of them in the kept bytes): the bytes kept for
        `old`, if any, stand for `new` (a clock save re-encodes no record)."""
        entry = self._parts.get(new.job_id)
        if entry is not None and entry[0] is old:
            self._parts[new.job_id] = (new, entry[1], entry[2])

    def encode(self, records: Mapping[str, JobRecord], statuses: Iterable[tuple]) -> list[bytes]:
        """The JSON public form of each of `records`, in order, with its live fields from
        `statuses` (Scheduler.wait_statuses: (waiting_on, waiting_on_job, queue_wait_ms,
        waiting_detail) per record, in the same order). A list, not joined: the caller
        joins it once into the whole answer (a copy of 6 MB costs milliseconds)."""
        parts = self._parts
        memo: dict = {None: b"null"}  # encoded waiting_on and waiting_on_job values
        out = []
        encoded = 0
        for (job_id, record), (waiting_on, on_job, ms, detail) in zip(records.items(), statuses):
            entry = parts.get(job_id)
            if entry is None or entry[0] is not record:
                entry = parts[job_id] = (record, *encoded_parts(record))
                encoded += 1
            on = memo.get(waiting_on)
            if on is None:
                on = memo[waiting_on] = _encode(waiting_on)
            holder = memo.get(on_job)
            if holder is None:
                holder = memo[on_job] = _encode(on_job)
            if detail is None:
                out.append(b'%s%d,"waiting_on":%s,"waiting_on_job":%s%s'
                           % (entry[1], ms, on, holder, entry[2]))
            else:
                out.append(b'%s%d,"waiting_on":%s,"waiting_on_job":%s,"waiting_detail":%s%s'
                           % (entry[1], ms, on, holder, _encode(detail), entry[2]))
        if len(parts) != len(out):  # every job has its entry: the others are no longer queued
            self._parts = {job_id: parts[job_id] for job_id in records}
        self.encoded_last = encoded
        return out


def join_array(pieces: list[bytes], before: bytes = b"", after: bytes = b"") -> bytes:
    """`before + "[" + ",".join(pieces) + "]" + after`, copying the pieces once (the first
    and last items of `pieces` are replaced: pass a list you no longer need)."""
    if not pieces:
        return before + b"[]" + after
    pieces[0] = before + b"[" + pieces[0]
    pieces[-1] = pieces[-1] + b"]" + after
    return b",".join(pieces)
