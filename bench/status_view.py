"""The dispatcher's status view at scale, in process (issue 14): what `GET /v1/status`
costs inside the runner before the HTTP transfer.

    python bench/status_view.py [--n 10000] [--workspaces 2000] [--rounds 15]

A DispatchMachine (the pure core of the dispatcher, no trio, no store) is filled as the
runner fills it: one job of claim 2 (= max_weight) starts and holds all capacity, then N
jobs of claim 1 are admitted over `--workspaces` workspaces (job i in workspace i % W).
Each round, time moves on 0.25 s (so every queue_wait_ms changes), and is timed:

- `status_view_dicts`: the StatusView event (the view as Python dicts, what the embedding
  API's `runner.status()` returns), then the same view encoded to JSON with msgspec (what
  the API sent before the encoded view existed);
- `status_view_encoded`: the encoded view of status rows (bytes of `{"queued": [...]`, what
  `GET /v1/status` sends), with every row's encoded form cached and no event between two
  views (since stop 31 that is the view before with its clocks run on, `QueuedJson.again`);
- `status_view_after_event`: the same with an event between two views: one more job
  submitted (untimed) behind a workspace's head; since stop 32 the view before patched
  with the jobs that moved (`redone=`: how many took their wait fields anew; before, every
  row from its kept bytes and the core's wait fields);
- `status_view_after_start` (since stop 32, at the end): the rows after a running job ended
  and the next head started (`redone=`: the jobs of the two workspaces that moved);
- `status_view_cold`: the encoded view right after every record was replaced (each record
  encoded again: what the first view after a fill, or a restart, costs);
- `status_view_full_encoded`, `status_view_full_cold`: the same with whole public records
  (`GET /v1/status?full=1`; what `GET /v1/status` answered before stop 31).

Printed in the peers' line format: the median (and p90) of the rounds' wall time, ms, the
median of their CPU time (`cpu_ms`, this process only: steadier than wall time on a loaded
machine), and the bytes. Read the figures with the load average printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchlib import load1

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import msgspec  # noqa: E402

from motor.records import JobRequest  # noqa: E402
from motor.scheduling import machine as m  # noqa: E402
from motor.scheduling.admission import AdmissionSettings  # noqa: E402
from motor.scheduling.messages import StatusView  # noqa: E402


def emit(metric: str, values: list[tuple[float, float]], extra: str) -> None:
    """values: (wall ms, CPU ms of this process) per round; the CPU time is the steadier
    figure on a loaded machine (it does not count the time the process waited for a core)."""
    walls = sorted(w for w, _ in values)
    p90 = walls[min(len(walls) - 1, int(round(0.9 * (len(walls) - 1))))]
    cpu = statistics.median(c for _, c in values)
    print(f"peer=motor metric={metric} value={statistics.median(walls):.3f} unit=ms "
          f"load1={load1()} p90={p90:.3f} cpu_ms={cpu:.3f} rounds={len(values)} {extra}",
          flush=True)


class Timer:
    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.value = ((time.perf_counter() - self.wall) * 1000.0,
                      (time.process_time() - self.cpu) * 1000.0)


def run(machine: m.DispatchMachine, event, now: float, wall_ms: int) -> list:
    """Carry out the effects as the actor shell does (saves succeed, CPUs are placed)."""
    done, pending = [], list(reversed(machine.handle(event, now, wall_ms)))
    while pending:
        effect = pending.pop()
        done.append(effect)
        answer = None
        if isinstance(effect, m.SaveRecord):
            answer = m.SaveDone(effect)
        elif isinstance(effect, m.PlaceCpus):
            answer = m.Placed(effect.job_id, list(range(effect.claim)))
        elif isinstance(effect, m.Continue):
            answer = effect.event
        if answer is not None:
            pending.extend(reversed(machine.handle(answer, now, wall_ms)))
    return done


def fill(n: int, workspaces: int) -> tuple[m.DispatchMachine, float, int]:
    settings = AdmissionSettings(claim_limit=2, max_weight=2, max_queue_depth=n + 100)
    machine = m.DispatchMachine.new(settings)
    now, wall = 0.0, 1_764_585_000_000
    jobs = [("blocker", ["sleep", "3600"], 2)]
    jobs += [(f"ws{i % workspaces}", ["true"], 1) for i in range(n)]
    for i, (ws, command, claim) in enumerate(jobs):
        job_id = f"019ad{i:08x}-7000-8000-{i:012x}"
        req = JobRequest(command=command, workspace=ws, weight_hint=claim)
        run(machine, m.SubmitReceived(None, req, False, job_id), now, wall)
        run(machine, m.DiskAnswered(job_id, None), now, wall)
        now, wall = now + 0.004, wall + 4
    assert len(machine.queued) == n and len(machine.active) == 1
    return machine, now, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--workspaces", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(f"# status_view: n={args.n} workspaces={args.workspaces} load1={load1()}", flush=True)
    machine, now, wall = fill(args.n, args.workspaces)
    encoder = msgspec.json.Encoder()
    extra = f"queued={args.n}"

    dicts, size = [], 0
    for _ in range(args.rounds):
        now, wall = now + 0.25, wall + 250
        with Timer() as t:
            [reply] = [e for e in run(machine, StatusView(), now, wall) if isinstance(e, m.Reply)]
            size = len(encoder.encode(reply.value))
        dicts.append(t.value)
    emit("status_view_dicts", dicts, f"{extra} bytes={size}")
    if not hasattr(StatusView(), "encoded"):  # before the encoded view existed
        return 0
    from motor.scheduling.view import join_array

    rows = hasattr(StatusView(), "full")  # since the status rows (stop 31)

    def encoded_view(full: bool) -> bytes:
        event = StatusView(encoded=True, full=full) if rows else StatusView(encoded=True)
        [reply] = [e for e in run(machine, event, now, wall) if isinstance(e, m.Reply)]
        return join_array(reply.value["queued"])

    # the status rows (GET /v1/status), then the whole records (?full=1; before stop 31,
    # what GET /v1/status answered)
    for full, name in ((False, "status_view_encoded"), (True, "status_view_full_encoded")):
        if not rows and not full:
            continue
        cache = machine.queued_json if full or not rows else machine.queued_rows
        again = hasattr(cache, "again")  # since stop 31: the view before, if only time moved
        warm, changed, cold = [], [], []
        encoded_view(full)  # the first view encodes every record
        for _ in range(args.rounds):
            now, wall = now + 0.25, wall + 250
            with Timer() as t:
                body = encoded_view(full)
            warm.append(t.value)
            assert cache.encoded_last == 0
        emit(name, warm, f"queued={len(machine.queued)} bytes={len(body)}")
        if again:  # after an event: one more job submitted (untimed), as bench/scale.py
            patch = hasattr(cache, "patch")  # since stop 32: the view before, patched
            redone = []
            for r in range(args.rounds):
                if patch:
                    job_id = f"019ae{r + (args.rounds if full else 0):08x}-7000-8000-0"
                    req = JobRequest(command=["true"], workspace=f"ws{r}", weight_hint=1)
                    run(machine, m.SubmitReceived(None, req, False, job_id), now, wall)
                    run(machine, m.DiskAnswered(job_id, None), now, wall)
                else:  # before: any event built the view from the records (counted as one)
                    machine.events += 1
                now, wall = now + 0.25, wall + 250
                with Timer() as t:
                    encoded_view(full)
                changed.append(t.value)
                assert not cache.again_last
                redone.append(getattr(cache, "redone_last", len(machine.queued)))
            emit(name.replace("encoded", "after_event"), changed,
                 f"queued={len(machine.queued)} redone={statistics.median(redone):g}")
        for _ in range(max(3, args.rounds // 3)):
            for job_id, record in machine.queued.items():  # every record replaced (same values)
                machine.queued[job_id] = msgspec.structs.replace(record)
            if again:
                machine.events += 1  # records change only in events
            now, wall = now + 0.25, wall + 250
            with Timer() as t:
                encoded_view(full)
            cold.append(t.value)
            assert cache.encoded_last == len(machine.queued)
        emit(name.replace("encoded", "cold"), cold, f"queued={len(machine.queued)} encoded={len(machine.queued)}")
    if hasattr(machine.queued_rows, "patch"):  # since stop 32
        # after a start: a running job ends and the next head starts before each view (the
        # first round ends the blocker: two heads start)
        started, redone = [], []
        for _ in range(args.rounds):
            run(machine, m.Finished(sorted(machine.active)[0]), now, wall)
            now, wall = now + 0.25, wall + 250
            with Timer() as t:
                encoded_view(False)
            started.append(t.value)
            redone.append(machine.queued_rows.redone_last)
        emit("status_view_after_start", started,
             f"queued={len(machine.queued)} redone={statistics.median(redone):g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
