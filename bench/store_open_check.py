"""Start-up cost of the job database's integrity check (`PRAGMA quick_check`).

    python bench/store_open_check.py [--mib 50 200]

For each size: fills a fresh motor.db with job records and output events (1 KiB each)
through `Database.save` until the file reaches about that many MiB, closes it, then times
opening it the way the runner does at start-up (`Database(..., check=True)`) against an
open without the check. Prints one line per size: file MiB, open ms without and with the
check (best of 3, page cache warm).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from motor.clock import uuid7  # noqa: E402
from motor.records import JobRecord, Output  # noqa: E402
from motor.store.db import Database  # noqa: E402


def fill(path: Path, mib: int) -> None:
    db = Database(path)
    line = "x" * 1023 + "\n"
    n = 0
    while path.stat().st_size + (path.with_name(path.name + "-wal").stat().st_size
                                  if path.with_name(path.name + "-wal").exists() else 0) < mib << 20:
        job_id = uuid7(1_800_000_000_000 + n)
        record = JobRecord(job_id=job_id, state="succeeded", workspace="w", command=["true"])
        db.save(record, [Output(stream="stdout", data=line) for _ in range(256)])
        n += 1
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()


def best_open_ms(path: Path, check: bool) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        Database(path, check=check).close()
        times.append((time.perf_counter() - t0) * 1000)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, nargs="+", default=[50, 200])
    args = parser.parse_args()
    for mib in args.mib:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "motor.db"
            fill(path, mib)
            size = path.stat().st_size / (1 << 20)
            plain, checked = best_open_ms(path, False), best_open_ms(path, True)
            print(f"motor.db {size:.0f} MiB: open {plain:.1f} ms, open with quick_check {checked:.1f} ms")


if __name__ == "__main__":
    main()
