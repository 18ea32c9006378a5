"""Benchmark: the disk actor's cost per job while draining a deep queue.

A real SQLite store (motor.store.db.Database) holds --queued queued jobs spread over
--workspaces workspaces (each a small real tree of --files files), all catalogued. Then
--drain jobs run through the disk actor the way the runner drives it: the record goes to
`setup`, `PrepareSetup`, the record goes to `running`, then to `succeeded`, `JobIdle`. Only
the two disk-actor calls are timed (wall and process CPU, which includes the walk threads);
the store writes are not. The first job after start (one-time costs: reading the live
records, walking uncached workspaces) is timed and printed apart; the per-job figures are
over the --drain jobs after it. With a live index (this code) every store write also feeds the
index, as `ChangeHub.saved` does in the runner; `--mode records` makes the actor read every
live record on each check instead (the previous way, kept as the reference).

Prints per-job medians over --rounds rounds (each round a fresh state), the load average,
and which motor package was measured (run it with PYTHONPATH=<an export of another commit>
to measure that commit).

    python bench/disk_actor.py [--queued 10000] [--workspaces 2000] [--drain 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

import actors
import motor
from motor.disk.actor import DiskActor, JobIdle, PrepareSetup
from motor.records import JobRecord
from motor.store.db import Database

try:
    from motor.disk.live import LiveIndex
except ImportError:  # an older commit
    LiveIndex = None


def make_tree(path: Path, files: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "target" / "debug").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (path / ("target/debug" if i % 2 else ".") / f"f{i}").write_bytes(b"x" * (100 + i))


async def one_round(args, mode: str) -> tuple[float, float]:
    tmp = Path(tempfile.mkdtemp(prefix="motor-disk-bench-", dir=args.dir))
    try:
        state = tmp / "state"
        state.mkdir()
        db = Database(state / "motor.db")
        index = LiveIndex(db.live) if mode == "index" else None

        def save(r: JobRecord) -> None:
            db.save(r)
            if index is not None:
                index.apply(r)

        kw = {"live_index": index} if index is not None else {}
        actor = DiskActor(state, 1, 1, workspace_roots=[state / "workspaces"],
                          live_jobs=db.live, job_recorded=lambda j: db.get(j) is not None, **kw)
        sup = actors.Supervisor("bench", [actors.ChildSpec(name="disk", factory=lambda: actor)])
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            ref = sup.ref("disk")
            names = [f"ws{i:05d}" for i in range(args.workspaces)]  # ws i: jobs i, i+W, ...
            for i, name in enumerate(names):  # catalogue every workspace once (untimed)
                plan = await ref.call(PrepareSetup(f"prep-{i}", name))
                make_tree(Path(plan.path), args.files)
            jobs = []
            for i in range(args.queued):
                r = JobRecord(job_id=f"job-{i:06d}", state="queued",
                              workspace=names[i % len(names)], command=["true"])
                save(r)
                jobs.append(r)
            wall = cpu = 0.0
            first = None
            for k, r in enumerate(jobs[:args.drain + 1]):
                if k == 1:  # the first job after start pays one-time costs: shown apart
                    first, wall, cpu = (wall, cpu), 0.0, 0.0
                save(JobRecord(job_id=r.job_id, state="setup", workspace=r.workspace))
                t, c = time.perf_counter(), time.process_time()
                await ref.call(PrepareSetup(r.job_id, r.workspace))
                wall += time.perf_counter() - t
                cpu += time.process_time() - c
                save(JobRecord(job_id=r.job_id, state="running", workspace=r.workspace))
                save(JobRecord(job_id=r.job_id, state="succeeded", workspace=r.workspace))
                t, c = time.perf_counter(), time.process_time()
                await ref.call(JobIdle(r.job_id, r.workspace))
                wall += time.perf_counter() - t
                cpu += time.process_time() - c
            sup.shutdown()
        db.close()
        return wall / args.drain, cpu / args.drain, first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--workspaces", type=int, default=2_000)
    ap.add_argument("--files", type=int, default=20, help="files per workspace tree")
    ap.add_argument("--drain", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=["index", "records"], default=None,
                    help="default: index when this motor has one, else records")
    ap.add_argument("--dir", default=None, help="parent of the temporary state")
    args = ap.parse_args()
    args.rounds = max(3, args.rounds)
    has_index = LiveIndex is not None and "live_index" in inspect.signature(DiskActor).parameters
    mode = args.mode or ("index" if has_index else "records")
    print(f"motor: {os.path.dirname(motor.__file__)}; mode: {mode}; {args.queued} queued over "
          f"{args.workspaces} workspaces ({args.files} files each); {args.drain} jobs drained")
    print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    walls, cpus = [], []
    for k in range(args.rounds):
        wall, cpu, first = trio.run(one_round, args, mode)
        walls.append(wall)
        cpus.append(cpu)
        print(f"round {k + 1}: {wall * 1000:.2f} ms wall, {cpu * 1000:.2f} ms CPU per job; "
              f"the first job after start: {first[0] * 1000:.1f} ms wall, "
              f"{first[1] * 1000:.1f} ms CPU")
    print(f"disk actor per job (PrepareSetup + JobIdle): median {statistics.median(walls) * 1000:.2f}"
          f" ms wall, {statistics.median(cpus) * 1000:.2f} ms CPU")
    print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
