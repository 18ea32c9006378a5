"""The queued part of the status view, as JSON bytes, each record encoded once (issue 14).

`GET /v1/status` answers a status row per queued and running job (`ROW_FIELDS`, then the
live wait fields; `?full=1`: the whole public record). Of each row or record only the live
wait fields (`queue_wait_ms`, `waiting_on`, `waiting_on_job`, `waiting_detail`) change
between two views while the record stays the same; the rest of it is encoded once and kept
as two byte strings, the part before `queue_wait_ms` and the part after the live fields. A
view then encodes only the live fields of each job and splices them between its two parts.

A cached entry holds the record it was encoded from and is used only while the dispatcher
still holds that same record object (`is`): every change to a queued record (a clock save,
a requeue after a failed start, a new budget enforcer) replaces the object
(`msgspec.structs.replace`, `lifecycle.advance`), never mutates it, so a replaced record is
encoded again at the next view. The entry's reference keeps the old object alive, so its
identity cannot be reused by another record. Entries of jobs no longer queued (started,
cancelled, withdrawn) are dropped at the next view.

The view before is kept too (`QueuedJson.again`, stop 31): while the dispatcher handled no
event but views and the core's `version` stands, nothing but the clocks moved, so the next
view is the kept pieces with each advancing clock's queue_wait_ms computed anew, without a
lookup per job. After events, the view before is patched (`QueuedJson.patch`, stop 32):
the dispatcher's queued records are a `Journaled` dict and the core journals the
workspaces and jobs whose waits or clocks moved (`Scheduler.moved_since`), so only those
jobs are taken anew.

Pure: no trio, no actors (the dispatcher's machine owns one `QueuedJson` for rows and one
for whole records).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice, repeat

import msgspec

from ..records import _INTERNAL_FIELDS, JobRecord
from .core import MOVED_MEMORY, wait_ms

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


#: a status row: what a queue view shows of a job (`GET /v1/status`; the whole record is
#: `GET /v1/jobs/{id}`, or `GET /v1/status?full=1`): its public record with only these
#: fields, in the record's order, and the live wait fields (last in both)
ROW_FIELDS = ("job_id", "state", "workspace", "command", "kind", "gate", "claim", "cpus",
              "accepted_at_ms", "started_at_ms")
LIVE_FIELDS = ("queue_wait_ms", "waiting_on", "waiting_on_job", "waiting_detail")
_ROW_MARK = b'"queue_wait_ms":0,"waiting_on":null,"waiting_on_job":null}'


def row_form(record: JobRecord, waiting_on: str | None, waiting_on_job: str | None,
             queue_wait_ms: int, waiting_detail: str | None) -> dict:
    """The status row of `record` with these live wait fields (`waiting_detail` only when
    there is one, as in a public record)."""
    row = {name: getattr(record, name) for name in ROW_FIELDS}
    row["queue_wait_ms"] = queue_wait_ms
    row["waiting_on"] = waiting_on
    row["waiting_on_job"] = waiting_on_job
    if waiting_detail is not None:
        row["waiting_detail"] = waiting_detail
    return row


def row_of(record: JobRecord) -> dict:
    """The status row of `record` with its own stored wait fields (a running job's)."""
    return row_form(record, record.waiting_on, record.waiting_on_job, record.queue_wait_ms,
                    record.waiting_detail)


def row_parts(record: JobRecord) -> tuple[bytes, bytes]:
    """`encoded_parts` for the status row: (the encoded row up to and including
    `"queue_wait_ms":`, the closing brace)."""
    raw = _encode(row_form(record, None, None, 0, None))
    if not raw.endswith(_ROW_MARK):  # ROW_FIELDS changed: the live fields are no longer last
        raise ValueError("status view: the live wait fields of a row are not last")
    return raw[:len(raw) - len(_ROW_MARK) + len(b'"queue_wait_ms":')], b"}"


class Journaled(dict):
    """A dict that journals the keys set in it and removed from it (`moved_since`): the
    dispatcher's queued records, so that a status view can patch the view before with the
    records that changed instead of going over every one. A change it cannot journal key
    by key (`update`, `clear`, ...) starts a new epoch: the next view is built afresh."""

    __slots__ = ("_set", "_dropped", "_epoch")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._set: list = []
        self._dropped: list = []
        self._epoch = 0

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        self._note(self._set, key)

    def __delitem__(self, key) -> None:
        dict.__delitem__(self, key)
        self._note(self._dropped, key)

    def pop(self, key, *default):
        if key in self:
            self._note(self._dropped, key)
        return dict.pop(self, key, *default)

    def _note(self, journal: list, key) -> None:
        journal.append(key)
        if len(journal) > MOVED_MEMORY:
            self._forget()

    def _forget(self) -> None:
        self._set = []
        self._dropped = []
        self._epoch += 1

    def _unjournaled(name):  # noqa: N805 - builds the methods below
        def method(self, *args, **kwargs):
            self._forget()
            return getattr(dict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    update = _unjournaled("update")
    setdefault = _unjournaled("setdefault")
    popitem = _unjournaled("popitem")
    clear = _unjournaled("clear")
    __ior__ = _unjournaled("__ior__")
    del _unjournaled

    def mark(self) -> tuple[int, int, int]:
        """Where the journal stands now, for `moved_since`."""
        return (self._epoch, len(self._set), len(self._dropped))

    def moved_since(self, mark: tuple[int, int, int]) -> tuple[list, list] | None:
        """(keys set since `mark`, keys removed since), in order, or None when the journal
        since then was dropped."""
        epoch, n_set, n_dropped = mark
        if epoch != self._epoch:
            return None
        return self._set[n_set:], self._dropped[n_dropped:]


class _Kept:
    """The last view of a `QueuedJson`, kept for the next: per job in view order its id, its
    kept head bytes, its clock (seconds held, advancing since or None) and the rest of its
    bytes (after queue_wait_ms when the clock advances, else from it), and where the
    journals stood (`key`, the core's and the records' marks)."""

    __slots__ = ("key", "marks", "ids", "pos", "heads", "held", "sinces", "rests")

    def __init__(self, key, marks, ids, heads, held, sinces, rests) -> None:
        self.key, self.marks = key, marks
        self.ids, self.heads, self.held, self.sinces, self.rests = ids, heads, held, sinces, rests
        self.pos = dict(zip(ids, range(len(ids))))

    def pieces(self, t: float) -> list[bytes]:
        """The view at time `t`: each job's kept bytes and its queue_wait_ms from its clock
        (`core.wait_ms`), a comma between two jobs."""
        out: list[bytes] = []
        add = out.append
        for head, acc, since, rest in zip(self.heads, self.held, self.sinces, self.rests):
            add(head)
            if since is None:
                add(rest)  # a paused clock: the whole rest was kept
            else:
                add(b"%d%s" % (wait_ms(acc, since, t), rest))
        if out:
            out[-1] = out[-1][:-1]
        return out

    def drop(self, gone: set) -> None:
        """Take the jobs in `gone` out of the kept view."""
        pos, ids = self.pos, self.ids
        at = sorted(pos.pop(job_id) for job_id in gone)
        columns = (ids, self.heads, self.held, self.sinces, self.rests)
        if len(at) <= 64:  # a few: each a memmove
            for i in reversed(at):
                for column in columns:
                    del column[i]
        else:
            keep = [i for i, job_id in enumerate(ids) if job_id not in gone]
            for column in columns:
                column[:] = [column[i] for i in keep]
        for i in range(at[0], len(ids)):
            pos[ids[i]] = i

    def add(self, job_id: str) -> None:
        """A job at the end of the view, its bytes and clock to be set (`QueuedJson.patch`)."""
        self.pos[job_id] = len(self.ids)
        self.ids.append(job_id)
        self.heads.append(b"")
        self.held.append(0.0)
        self.sinces.append(None)
        self.rests.append(b"")


class QueuedJson:
    """The encoded public records (or status rows, with `row_parts`) of the queued jobs,
    kept across views (see the module)."""

    #: `patch` builds the view afresh (`encode`) when more than this share of the jobs, and
    #: more than PATCH_MIN jobs, moved (a short queue is patched whatever moved)
    PATCH_SHARE = 0.5
    PATCH_MIN = 64

    def __init__(self, parts=encoded_parts) -> None:
        self._make_parts = parts
        #: the last view, kept for `again` and `patch`
        self._kept: _Kept | None = None
        #: how the last view was made: "again", "patch" or "encode"
        self.last_made = ""
        #: {job_id: (the record encoded, head bytes, tail bytes)}
        self._parts: dict[str, tuple[JobRecord, bytes, bytes]] = {}
        #: records encoded by the last view (fresh or replaced since the one before)
        self.encoded_last = 0
        self._encoded = 0  # records encoded so far by the view being made
        #: jobs whose wait fields and clock the last view took anew (all of them unless
        #: it was patched or `again`)
        self.redone_last = 0

    @property
    def again_last(self) -> bool:
        """The last view was the one before with its clocks run on (`again`)."""
        return self.last_made == "again"

    def __len__(self) -> int:
        return len(self._parts)

    def carry(self, old: JobRecord, new: JobRecord) -> None:
        """`new` replaces `old` with only its clock changed (`queue_wait_ms`, a live field,
        and the internal clock fields, none of them in the kept bytes): the bytes kept for
        `old`, if any, stand for `new` (a clock save re-encodes no record)."""
        entry = self._parts.get(new.job_id)
        if entry is not None and entry[0] is old:
            self._parts[new.job_id] = (new, entry[1], entry[2])

    def again(self, key: object, t: float) -> list[bytes] | None:
        """The last view at time `t`, if it was made with `key` (the dispatcher's count of
        events, the core's `version` and the records' journal mark: while they stand, only
        the clocks ran on), without
        a lookup per job: each one's kept bytes, and its queue_wait_ms from its clock
        (`core.wait_ms`). None when `key` is another."""
        kept = self._kept
        if kept is None or kept.key != key:
            return None
        self.last_made = "again"
        self.encoded_last = self.redone_last = 0
        return kept.pieces(t)

    def patch(self, records: Journaled, core, now: float, key: object) -> list[bytes] | None:
        """The last view brought up to `now`, changing only the jobs that moved since it:
        those whose record was set or removed (`records`' journal) and those whose wait
        fields or clock the core may have changed (`core.moved_since`); the others keep
        their bytes and clocks. Jobs that joined are at the end of `records` (a dict keeps
        insertion order), and so at the end of the view. None when there is no view
        before, a journal since it was dropped, or more than `PATCH_SHARE` of the jobs (and
        more than `PATCH_MIN`) moved: `encode` then builds the view afresh."""
        kept = self._kept
        if kept is None or kept.marks is None:
            return None
        core_mark, records_mark = kept.marks
        moved = core.moved_since(core_mark)
        changed = records.moved_since(records_mark)
        if moved is None or changed is None:
            return None
        set_keys, dropped = changed
        dropped = set(dropped)
        pos = kept.pos
        # removed since (a key removed and set again moved to the end of `records`)
        gone = {job_id for job_id in dropped if job_id in pos}
        new = {job_id for job_id in set_keys if job_id in records
               and (job_id not in pos or job_id in dropped)}
        redo = {job_id for job_id in moved if job_id in records}
        redo.update(job_id for job_id in set_keys if job_id in records)
        if len(gone) + len(redo) > max(self.PATCH_SHARE * len(records), self.PATCH_MIN):
            return None
        tail = list(islice(reversed(records.keys()), len(new)))
        if set(tail) != new:
            return None  # not only appended: (not so while every change is journaled)
        if gone:
            kept.drop(gone)
            parts = self._parts
            for job_id in gone:
                if job_id not in records:
                    parts.pop(job_id, None)
        for job_id in reversed(tail):
            kept.add(job_id)
        if len(kept.ids) != len(records):
            return None  # the journals missed a change: (not so while every one is journaled)
        order = list(redo)
        clocks: tuple[list, list] = ([], [])
        waits_ms, waits = core.wait_columns(order, now, clocks)
        self.encoded_last = self._set(kept, order, records, waits_ms, waits, clocks)
        kept.key = key
        kept.marks = (core.moved_mark(), records.mark())
        self.last_made = "patch"
        self.redone_last = len(order)
        return kept.pieces(core.refresh(now))

    def _set(self, kept: _Kept, order: list[str], records: Mapping[str, JobRecord],
             waits_ms: list[int], waits: list[tuple], clocks: tuple[list, list]) -> int:
        """Set the kept bytes and clock of each job of `order` from its record and its wait
        (`wait_columns`'s columns, in that order); the count of records encoded anew."""
        pos = kept.pos
        heads, held, sinces, rests = kept.heads, kept.held, kept.sinces, kept.rests
        mids: dict[int, bytes] = {}
        self._encoded = 0
        for job_id, ms, wait, acc, since in zip(order, waits_ms, waits, *clocks):
            entry, mid = self._bytes_of(job_id, records[job_id], wait, mids)
            i = pos[job_id]
            heads[i] = entry[1]
            held[i] = acc
            sinces[i] = since
            rests[i] = (b"%d%s%s," % (ms, mid, entry[2]) if since is None
                        else mid + entry[2] + b",")
        return self._encoded

    def _bytes_of(self, job_id: str, record: JobRecord, wait: tuple,
                  mids: dict[int, bytes]) -> tuple[tuple, bytes]:
        """(the kept entry of `record`, encoded anew, and counted in `_encoded`, unless kept
        for this same object; the encoded live fields of `wait` after queue_wait_ms, by the
        identity of the tuple in `mids`: the jobs behind one workspace head share theirs
        (Scheduler.wait_columns), and each tuple lives until the view ends, so no identity
        is reused meanwhile)."""
        entry = self._parts.get(job_id)
        if entry is None or entry[0] is not record:
            entry = self._parts[job_id] = (record, *self._make_parts(record))
            self._encoded += 1
        mid = mids.get(id(wait))
        if mid is None:
            mid = mids[id(wait)] = _live_bytes(*wait)
        return entry, mid

    def encode(self, records: Mapping[str, JobRecord], waits_ms: Iterable[int],
               waits: Iterable[tuple], clocks: tuple[list, list] | None = None,
               key: object = None, marks: tuple | None = None) -> list[bytes]:
        """The JSON of each of `records`, in order, with its live fields from `waits_ms` and
        `waits` (Scheduler.wait_columns: queue_wait_ms, and (waiting_on, waiting_on_job,
        waiting_detail), per record, in the same order). A list of pieces, not joined: the
        caller joins it once into the whole answer (`join_array`: a copy of megabytes costs
        milliseconds). Each record is two pieces, its kept head and the rest, a comma after
        every record but the last, so the head is copied once, by the join. With `clocks`
        (Scheduler.wait_columns's) the view is kept for `again` under `key`, and for `patch`
        with `marks` (the core's `moved_mark` and the records' `mark` at this view)."""
        mids: dict[int, bytes] = {}
        out: list[bytes] = []
        add = out.append
        self._encoded = 0
        heads: list[bytes] = []
        rests: list[bytes] = []
        keep = clocks is not None
        held, sinces = clocks if keep else (repeat(None), repeat(None))
        for (job_id, record), ms, wait, since in zip(records.items(), waits_ms, waits, sinces):
            entry, mid = self._bytes_of(job_id, record, wait, mids)
            rest = b"%d%s%s," % (ms, mid, entry[2])
            add(entry[1])
            add(rest)
            if keep:  # a paused clock's whole rest, else the rest after the ms
                heads.append(entry[1])
                rests.append(rest if since is None else mid + entry[2] + b",")
        self._kept = _Kept(key, marks, list(records), heads, held, sinces, rests) if keep else None
        self.last_made = "encode"
        if out:
            out[-1] = out[-1][:-1]
        parts = self._parts
        if len(parts) * 2 != len(out):  # every job has its entry: the others are no longer queued
            self._parts = {job_id: parts[job_id] for job_id in records}
        self.encoded_last = self._encoded
        self.redone_last = len(out) // 2
        return out


def _live_bytes(waiting_on: str | None, waiting_on_job: str | None,
                waiting_detail: str | None) -> bytes:
    """The encoded live fields that follow `"queue_wait_ms":N` (waiting_detail only when set)."""
    out = b',"waiting_on":%s,"waiting_on_job":%s' % (_encode(waiting_on), _encode(waiting_on_job))
    if waiting_detail is not None:
        out += b',"waiting_detail":' + _encode(waiting_detail)
    return out


def join_array(pieces: list[bytes], before: bytes = b"", after: bytes = b"") -> bytes:
    """`before + "[" + b"".join(pieces) + "]" + after`, copying the pieces once: `pieces` is
    `QueuedJson.encode`'s list (the separators are in it; the list gets the two ends
    inserted: pass a list you no longer need)."""
    pieces.insert(0, before + b"[")
    pieces.append(b"]" + after)
    return b"".join(pieces)
