"""`motor status` through a real runner (issue 14): each queued and running job is a status
row, its public record with only the fields a queue view shows (scheduling/view.py
ROW_FIELDS, then the live wait fields); `--full` (`GET /v1/status?full=1`) answers the
whole records instead."""

from __future__ import annotations

import time

import pytest

from motor.scheduling.view import LIVE_FIELDS, ROW_FIELDS
from polling import wait_for

pytestmark = pytest.mark.e2e


def test_status_answers_rows_and_full_answers_whole_records(serve_factory, tmp_path):
    serve = serve_factory("--max-weight", "1").start()
    gate = tmp_path / "go"
    hold = serve.cli_json("submit", "--weight", "1", "--workspace", "a", "--",
                          "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done")
    queued = serve.cli_json("submit", "--weight", "1", "--workspace", "b", "--", "echo", "later")
    serve.wait_until_it_runs(hold["job_id"])

    rows, full = serve.cli_json("status"), serve.cli_json("status", "--full")
    assert [r["job_id"] for r in rows["queued"]] == [queued["job_id"]]
    assert rows["capacity"] == full["capacity"]
    for kind in ("queued", "running"):
        [row], [record] = rows[kind], full[kind]
        assert set(row) == set(ROW_FIELDS) | set(LIVE_FIELDS[:3])  # no waiting_detail unset
        assert {"memory_max_bytes", "workspace_kind", "attempts"} <= set(record)
        shown = {k: v for k, v in record.items() if k in row}
        del shown["queue_wait_ms"], row["queue_wait_ms"]  # a queued job's clock moved on
        assert shown == row
    assert rows["queued"][0]["waiting_on"] == "permits"

    # views with nothing but time between them (the second from the view before, stop 31):
    # the queued job's clock runs on by the time between, its wait stays
    first = serve.cli_json("status")["queued"][0]
    time.sleep(0.5)
    second = serve.cli_json("status")["queued"][0]
    assert second["queue_wait_ms"] - first["queue_wait_ms"] >= 500
    assert {k: v for k, v in second.items() if k != "queue_wait_ms"} == \
        {k: v for k, v in first.items() if k != "queue_wait_ms"}
    assert rows["running"][0]["cpus"] == full["running"][0]["cpus"] and rows["running"][0]["cpus"]

    text = serve.cli("status")
    assert text.returncode == 0 and "permits" in text.stdout.decode()
    gate.write_text("")
    ids = {hold["job_id"], queued["job_id"]}
    wait_for(lambda: {r["state"] for r in serve.cli_json("jobs") if r["job_id"] in ids}
             == {"succeeded"}, what="both jobs to succeed")
    assert serve.cli_json("status")["queued"] == []


def test_views_after_events_follow_each_change_of_the_queue(serve_factory, tmp_path):
    """Stop 32: after an event a view is the view before patched with the jobs that moved
    (a short queue is always patched). Through a real runner and the CLI: a job that joins
    a workspace's queue waits on its head; once that head is cancelled the next one heads
    the workspace and the job behind it waits on the new head, though no record of theirs
    changed; each view's rows are the cut of the whole records of the same instant."""
    serve = serve_factory("--max-weight", "1").start()
    gate = tmp_path / "go"
    hold = serve.cli_json("submit", "--weight", "1", "--workspace", "a", "--",
                          "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done")
    serve.wait_until_it_runs(hold["job_id"])
    b1, b2 = (serve.cli_json("submit", "--weight", "1", "--workspace", "b", "--", "true")
              for _ in range(2))

    def waits() -> dict:
        rows, full = serve.cli_json("status"), serve.cli_json("status", "--full")
        cut = [{k: v for k, v in r.items() if k in ROW_FIELDS or k in LIVE_FIELDS[1:]}
               for r in full["queued"]]
        assert [{k: v for k, v in r.items() if k != "queue_wait_ms"} for r in rows["queued"]] == cut
        return {r["job_id"]: (r["waiting_on"], r["waiting_on_job"]) for r in rows["queued"]}

    assert waits() == {b1["job_id"]: ("permits", None),
                       b2["job_id"]: ("workspace_owner", b1["job_id"])}
    b3 = serve.cli_json("submit", "--weight", "1", "--workspace", "b", "--", "true")
    assert waits()[b3["job_id"]] == ("workspace_owner", b1["job_id"])
    assert serve.cli("cancel", b1["job_id"]).returncode == 0
    assert waits() == {b2["job_id"]: ("permits", None),
                       b3["job_id"]: ("workspace_owner", b2["job_id"])}
    gate.write_text("")
    ids = {hold["job_id"], b2["job_id"], b3["job_id"]}
    wait_for(lambda: {r["state"] for r in serve.cli_json("jobs") if r["job_id"] in ids}
             == {"succeeded"}, what="the jobs to succeed")
    assert waits() == {}
