"""Output is kept in pages; replay after evicted pages starts with a `truncated` event."""

from __future__ import annotations

from contextlib import aclosing

import motor
from motor.records import JobRequest
from motor.store.db import PAGE_EVENTS, Database

from runner_helpers import embedded_config


async def test_replay_after_evicted_pages_starts_with_truncated_before_seq(tmp_path, autojump_clock):
    lines = 3000
    config = embedded_config(tmp_path, max_output_bytes_per_job=20_000)
    # many small writes, flushed one by one and paced, so output arrives as many events
    script = (f"import sys, time\nfor i in range({lines}):\n    sys.stdout.write(f'line-{{i}}\\n')\n"
              "    sys.stdout.flush()\n    time.sleep(0.0002)\n")
    async with motor.open_runner(config) as runner:
        job = await runner.submit(JobRequest(command=["python3", "-c", script]))
        async with aclosing(runner.events(job.job_id)) as events:
            async for event in events:
                pass
        truncated_before = runner.db.truncated_before(job.job_id)
        assert truncated_before > 1 and (truncated_before - 1) % PAGE_EVENTS == 0  # whole pages

        async with aclosing(runner.events(job.job_id, 0)) as events:
            replay = [e async for e in events]
        first = replay[0]
        assert first.__struct_config__.tag == "truncated"
        assert first.truncated_before_seq == truncated_before
        seqs = [e.seq for e in replay]
        assert seqs == sorted(seqs)
        # the lifecycle events below the boundary are never evicted and still replayed
        tags = [e.__struct_config__.tag for e in replay]
        assert tags[1:4] == ["accepted", "queued", "started"], tags[:6]
        assert all(e.seq < truncated_before for e in replay[1:4])
        assert all(e.seq >= truncated_before for e in replay[4:])
        text = "".join(e.data for e in replay if e.__struct_config__.tag == "output")
        assert text.endswith(f"line-{lines - 1}\n")  # the newest output is all there
        assert 0 < len(text.encode()) <= 20_000
        assert replay[-1].__struct_config__.tag == "terminal"

        # replay from after the evicted pages: no truncated event
        async with aclosing(runner.events(job.job_id, truncated_before)) as events:
            later = [e async for e in events]
        assert later[0].__struct_config__.tag != "truncated"


def test_pages_are_evicted_oldest_first_and_non_output_events_stay(tmp_path):
    from motor.records import Accepted, JobRecord, Output

    db = Database(tmp_path / "motor.db", max_output_bytes=1000)
    record = JobRecord(job_id="j", state="running", workspace="w")
    db.save(record, [Accepted(job_id="j", claim=2)])
    for i in range(300):
        db.save(record, [Output(stream="stdout", data=f"{i:09d}\n")])
    cut = db.truncated_before("j")
    assert cut > 1
    kept = db.events_from("j", 0, limit=10_000)
    assert kept[0].startswith(b'{"event":"accepted"')  # never evicted
    outputs = [r for r in kept if r.startswith(b'{"event":"output"')]
    assert len(outputs) * 10 <= 1000 and outputs[-1].endswith(b'"000000299\\n","seq":301}')
