"""The encoded queued view (motor/scheduling/view.py): each record's cached encoded form
spliced with its live wait fields is byte for byte the encoding of records.public_record of
its live view, whatever the record holds."""

from __future__ import annotations

import msgspec

from motor.records import JobRecord, ReservationUse, public_record
from motor.scheduling.view import QueuedJson, encoded_parts, join_array, public_form

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
        pieces = view.encode({r.job_id: r for r in records}, live)
        assert join_array(pieces) == msgspec.json.encode(_expected(records, live))
        for record, fields in zip(records, live):
            assert public_form(record, *fields) == _expected([record], [fields])[0]


def test_encoded_parts_cut_at_the_records_own_fields():
    head, tail = encoded_parts(_records()[1])
    assert head.endswith(b',"queue_wait_ms":') and head.count(b'"queue_wait_ms"') == 1
    assert tail.startswith(b',"exit_code":') and tail.endswith(b"}")
    assert b'"env"' not in head + tail and b"budget_enforced_by" not in head + tail


def test_join_array_places_what_surrounds_the_pieces():
    assert join_array([], b"{", b"}") == b"{[]}"
    assert join_array([b"1"], b"<", b">") == b"<[1]>"
    assert join_array([b"1", b"2", b"3"]) == b"[1,2,3]"
