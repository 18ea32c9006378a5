"""The encoded queued view (motor/scheduling/view.py): each record's cached encoded form
spliced with its live wait fields is byte for byte the encoding of records.public_record of
its live view, whatever the record holds."""

from __future__ import annotations

import msgspec

from motor.records import JobRecord, ReservationUse, public_record
from motor.scheduling.view import (LIVE_FIELDS, ROW_FIELDS, QueuedJson, encoded_parts, join_array,
                                   public_form, row_form, row_parts)

#: the bytes the splice looks for, inside values where a naive search would find them
_TRAP = ',"queue_wait_ms":0,"waiting_on":null,"waiting_on_job":null,"exit_code":'


def _records() -> list[JobRecord]:
    return [
        JobRecord(job_id="j1", state="queued", workspace="w", command=["true"]),
        # strings holding the splice marks, quotes, backslashes, non-ASCII and control bytes
        JobRecord(job_id="j2", state="queued", workspace="w2", siblings=["s"],
                  repository=f"/src/{_TRAP}", command=["sh", "-c", f'echo "{_TRAP}" \\ é\n\x01'],
                  detail=_TRAP, reason="x\"y", env={"queue_wait_ms": "1", _TRAP: _TRAP},
                  waiting_on="permits", waiting_on_job="old", waiting_detail="stale",
                  queue_wait_ms=123, ready_at_ms=5, queue_clock_at_ms=6, queue_clock_running=True,
                  budget_enforced_by="runner"),
        # requeued after it ran once: measured, so reservation_use is shown
        JobRecord(job_id="j3", state="queued", workspace="w3", attempts=2, cpus=None,
                  memory_max_bytes=1 << 33, timeout_s=1.5, queue_wait_limit_s=0.0,
                  reservation_use=ReservationUse(cpu_time_ms=1, wall_time_ms=2,
                                                 average_use_ppm=500_000)),
    ]


LIVE = [("permits", None, 0, None), ("workspace_owner", "j1", 2_500, None),
        ("sibling_user", "j\"9", 10**12, 'claim 6 vCPUs exceeds "max_weight" 4: é')]


def _columns(live) -> tuple[list, list]:
    """`live` as Scheduler.wait_columns gives it: the waits in ms, the other fields."""
    return [ms for _, _, ms, _ in live], [(on, job, detail) for on, job, _, detail in live]


def _expected(records, live) -> list[dict]:
    out = []
    for record, (waiting_on, on_job, ms, detail) in zip(records, live):
        out.append(public_record(msgspec.structs.replace(
            record, waiting_on=waiting_on, waiting_on_job=on_job, queue_wait_ms=ms,
            waiting_detail=detail)))
    return out


def test_each_spliced_record_is_the_encoding_of_its_public_live_view():
    records = _records()
    for rotate in range(len(LIVE)):  # every record with every kind of live fields
        live = LIVE[rotate:] + LIVE[:rotate]
        view = QueuedJson()
        pieces = view.encode({r.job_id: r for r in records}, *_columns(live))
        assert join_array(pieces) == msgspec.json.encode(_expected(records, live))
        for record, fields in zip(records, live):
            assert public_form(record, *fields) == _expected([record], [fields])[0]


def test_each_spliced_status_row_is_its_public_live_view_with_only_the_row_fields():
    """A status row (GET /v1/status) is the record's public live view with only ROW_FIELDS and
    the live fields, in the record's order: spliced from its kept head, byte for byte."""
    records = _records()
    for rotate in range(len(LIVE)):
        live = LIVE[rotate:] + LIVE[:rotate]
        rows = [{k: v for k, v in public.items() if k in ROW_FIELDS or k in LIVE_FIELDS}
                for public in _expected(records, live)]
        view = QueuedJson(row_parts)
        pieces = view.encode({r.job_id: r for r in records}, *_columns(live))
        assert join_array(pieces) == msgspec.json.encode(rows)
        assert [row_form(r, *fields) for r, fields in zip(records, live)] == rows
    head, tail = row_parts(records[1])
    assert head.endswith(b',"queue_wait_ms":') and tail == b"}" and b"env" not in head


def test_encoded_parts_cut_at_the_records_own_fields():
    head, tail = encoded_parts(_records()[1])
    assert head.endswith(b',"queue_wait_ms":') and head.count(b'"queue_wait_ms"') == 1
    assert tail.startswith(b',"exit_code":') and tail.endswith(b"}")
    assert b'"env"' not in head + tail and b"budget_enforced_by" not in head + tail


def test_join_array_places_what_surrounds_the_pieces():
    assert join_array([], b"{", b"}") == b"{[]}"
    assert join_array([b"1"], b"<", b">") == b"<[1]>"
    assert join_array([b"1,", b"2,", b"3"]) == b"[1,2,3]"


def test_jobs_sharing_one_wait_tuple_and_equal_ones_apart_encode_the_same():
    """Wait tuples are memoized by identity within a view (the jobs behind one workspace
    head share one): shared, equal but distinct, and different ones each encode right."""
    records = [JobRecord(job_id=f"j{i}", state="queued", workspace="w", command=["true"])
               for i in range(5)]
    shared = ("workspace_owner", "j0", None)
    waits = [("permits", None, None), shared, shared, ("workspace_owner", "j0", None),
             ("sibling_user", "x", "too big")]
    pieces = QueuedJson(row_parts).encode({r.job_id: r for r in records}, range(5), waits)
    live = [(on, job, ms, detail) for ms, (on, job, detail) in enumerate(waits)]
    rows = [{k: v for k, v in public.items() if k in ROW_FIELDS or k in LIVE_FIELDS}
            for public in _expected(records, live)]
    assert join_array(pieces) == msgspec.json.encode(rows)
