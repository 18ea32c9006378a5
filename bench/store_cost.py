"""The runner's own cost per job, and its store writes: N jobs of `true` through the embedded runner.

    python bench/store_cost.py [--n 200] [--rounds 3] [--isolation affinity]

The set-up of bench/throughput.py (max_weight 2, claims of 1, jobs spread over 4 workspaces,
all N submitted one after another, then every job followed to its end), but in-process
(`motor.open_runner`), so that the runner's statements can be counted on its real SQLite
connection (its statement trace) and its CPU time read. Printed per round, in the peers'
line format:

  cpu_ms_per_job        CPU time of the runner process (user + system, all its threads; the
                        job processes and keepers are other processes) per job: what the
                        runner spends per job, much less sensitive to a loaded host than
                        wall time (throughput.py's figure)
  transactions_per_job  write transactions committed (COMMIT statements)
  saves_per_job         job records written (INSERT INTO jobs / UPDATE jobs statements)
  store_ms_per_job      CPU time of the runner's main thread inside the store actor's
                        commits (`StoreActor._commit`: SQLite, encoding, the ChangeHub
                        watchers) per job
  clock_saves_per_job   queue-wait clocks written alone (rows into the `clocks` table,
                        store/db.py; each row of an executemany is traced on its own)
  wall_s                first submit until every job ended

The host is shared: read the load (`load1`) next to the wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import motor  # noqa: E402
from motor.records import JobRequest  # noqa: E402
from motor.store.actor import StoreActor  # noqa: E402

_store_s = [0.0]
_commit = StoreActor._commit


async def _timed_commit(self, msgs, off_loop):
    # the main thread's CPU: on the loop the whole commit (it never suspends there); off
    # the loop only its share of the work (the transaction runs in a worker thread)
    t = time.thread_time()
    try:
        return await _commit(self, msgs, off_loop)
    finally:
        _store_s[0] += time.thread_time() - t


StoreActor._commit = _timed_commit


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process: every thread, no children
    return usage.ru_utime + usage.ru_stime


async def one_round(n: int, isolation: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="motor-store-cost-") as tmp:
        config = motor.RunnerConfig(state_dir=tmp, max_weight=2, isolation=isolation,
                                    free_space_floor_bytes=0, max_queue_depth=n + 10)
        async with motor.open_runner(config) as runner:
            warm = await runner.submit(JobRequest(command=["true"], workspace="warm",
                                                  weight_hint=1))
            async for _ in runner.events(warm.job_id):
                pass
            statements: list[str] = []
            runner.db.conn.set_trace_callback(statements.append)
            cpu0, t0, _store_s[0] = _cpu_s(), time.perf_counter(), 0.0
            ids = [(await runner.submit(JobRequest(command=["true"], workspace=f"ws{i % 4}",
                                                   weight_hint=1))).job_id for i in range(n)]
            for job_id in ids:
                async for _ in runner.events(job_id):
                    pass
            wall, cpu, store = time.perf_counter() - t0, _cpu_s() - cpu0, _store_s[0]
            runner.db.conn.set_trace_callback(None)
            states = [runner.db.get(j).state for j in ids]
            if states.count("succeeded") != n:
                raise SystemExit(f"not all succeeded: {sorted(set(states))}")
    commits = sum(1 for s in statements if s == "COMMIT")
    saves = sum(1 for s in statements if s.startswith(("INSERT INTO jobs", "UPDATE jobs SET state")))
    clocks = sum(1 for s in statements if s.startswith("INSERT OR REPLACE INTO clocks"))
    return {"cpu_ms_per_job": cpu * 1000 / n, "transactions_per_job": commits / n,
            "saves_per_job": saves / n, "store_ms_per_job": store * 1000 / n, "clock_saves_per_job": clocks / n, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isolation", default="affinity")
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        row = trio.run(one_round, args.n, args.isolation)
        rows.append(row)
        print(f"peer=motor metric=runner_cpu_per_job value={row['cpu_ms_per_job']:.3f} unit=ms "
              f"n={args.n} slots=2 store_ms_per_job={row['store_ms_per_job']:.3f} transactions_per_job={row['transactions_per_job']:.2f} "
              f"saves_per_job={row['saves_per_job']:.2f} "
              f"clock_saves_per_job={row['clock_saves_per_job']:.2f} wall_s={row['wall_s']:.3f} "
              f"jobs_per_s={args.n / row['wall_s']:.1f} isolation={args.isolation} "
              f"load1={os.getloadavg()[0]:.2f}", flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"# median: {med['cpu_ms_per_job']:.3f} ms runner CPU per job, "
          f"{med['transactions_per_job']:.2f} transactions, {med['saves_per_job']:.2f} "
          f"record saves and {med['clock_saves_per_job']:.2f} clock saves per job, {args.n / med['wall_s']:.1f} jobs/s", flush=True)


if __name__ == "__main__":
    main()
