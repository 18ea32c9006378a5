"""Health probe latency against 100,000 and 10,000 retained job records.

    python bench/health_probe.py [--records 100000] [--probes 200]

For each size: writes that many terminal records (ended within the last 24 h, 50
repositories, some underused) into a fresh state dir in one SQLite transaction, starts the
runner embedded (`motor.open_runner`, real clock), then times `runner.health()` (the same
call `GET /v1/health` makes). Probes read the accounting actor's indexes, never the
retained records, so the latency should not grow with the record count: the ratio printed
at the end should stay near 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import motor  # noqa: E402
from motor.clock import uuid7  # noqa: E402
from motor.records import JobRecord, ReservationUse  # noqa: E402
from motor.store.db import Database  # noqa: E402

HOUR_MS = 3600 * 1000


def fill(state: Path, n: int) -> None:
    """n retained terminal records, written in one transaction."""
    state.mkdir(parents=True, exist_ok=True)
    db = Database(state / "motor.db")
    encoder = msgspec.json.Encoder()
    now = time.time_ns() // 1_000_000
    rows = []
    for i in range(n):
        ended = now - (i * 20 * HOUR_MS) // n - 1000  # spread over the last 20 hours
        wall = 30_000 + (i % 97) * 10_000  # 30 s .. 16.5 min
        claim = (1, 2, 4, 8)[i % 4]
        ppm = 50_000 if i % 100 == 0 else 800_000  # 1% underused
        job_id = uuid7(ended - wall)
        record = JobRecord(
            job_id=job_id, state="succeeded", workspace=f"w{i % 200}",
            repository=f"/src/repo{i % 50}", command=["make", "-j", str(claim)], claim=claim,
            cpus=list(range(claim)), accepted_at_ms=ended - wall - 500,
            started_at_ms=ended - wall, ended_at_ms=ended, queue_wait_ms=i % 500, exit_code=0,
            reservation_use=ReservationUse(cpu_time_ms=wall * claim * ppm // 1_000_000,
                                           wall_time_ms=wall, average_use_ppm=ppm))
        rows.append((job_id, "succeeded", 1, encoder.encode(record), 0, 3,
                     max(ended, ended - wall) + 24 * HOUR_MS))
    db.conn.execute("BEGIN IMMEDIATE")
    db.conn.executemany(
        "INSERT INTO jobs (job_id, state, terminal, record, log_offset, next_seq, retain_until_ms)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    db.conn.execute("COMMIT")
    db.close()


async def probe(state: Path, probes: int) -> dict:
    config = motor.RunnerConfig(state_dir=str(state), isolation="none", free_space_floor_bytes=0)
    t0 = time.perf_counter()
    async with motor.open_runner(config) as runner:
        started_s = time.perf_counter() - t0
        first = await runner.health()  # warm-up
        times = []
        for _ in range(probes):
            t = time.perf_counter()
            report = await runner.health()
            times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {
        "start_s": started_s,
        "median_ms": statistics.median(times),
        "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))],
        "retained": report["retained_terminal_jobs"],
        "repositories": len(report["repositories"]),
        "underused": len(first["underused"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--probes", type=int, default=200)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="motor-health-bench-") as tmp:
        for n in (args.records, args.records // 10):
            state = Path(tmp) / f"state-{n}"
            t = time.perf_counter()
            fill(state, n)
            fill_s = time.perf_counter() - t
            r = trio.run(probe, state, args.probes)
            results[n] = r
            print(f"{n:>7} records: fill {fill_s:5.1f} s, runner start {r['start_s']:5.2f} s "
                  f"(accounting rebuild), probe median {r['median_ms']:.3f} ms, "
                  f"p99 {r['p99_ms']:.3f} ms  [{r['retained']} retained, "
                  f"{r['repositories']} repositories, {r['underused']} underused]")
    big, small = results[args.records], results[args.records // 10]
    print(f"ratio {args.records} / {args.records // 10}: median "
          f"{big['median_ms'] / small['median_ms']:.2f}x, p99 {big['p99_ms'] / small['p99_ms']:.2f}x "
          "(flat is ~1: probes read indexes, not records)")


if __name__ == "__main__":
    main()
