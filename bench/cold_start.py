"""The same small pieces of work, back to back and after the CPU was idle a while.

    python bench/cold_start.py [--samples 40] [--gaps 0,0.001,0.005,0.02,0.3] [--dir DIR]

The latency row starts one job on an idle runner, and on this host code that ran a moment
ago runs several times slower after even a few milliseconds of idleness
(docs/performance-history.md, "Stop 66"). This script times three pieces of work, each
after sleeping GAP seconds (0: back to back), in one process:

- `sqlite_commit`: one transaction as the store writes a job's start (a job row of about
  900 bytes and three event rows, WAL, synchronous=NORMAL) in a database under DIR
  (default: the temporary directory);
- `python_calls`: about 2,000 Python function calls (a recursive walk over a small tree
  of dicts), what motor's start path is made of;
- `fork_exec`: `posix_spawn` of `true` and its wait, what the bare peer does.

It prints, in the peers' line format, each piece's median per gap, and its ratio to the
back-to-back median (`cold_x`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import tempfile
import time

from benchlib import load1

TREE = {"k%d" % i: {"v%d" % j: j for j in range(6)} for i in range(40)}


def _walk(node) -> int:
    if isinstance(node, dict):
        return sum(_walk(v) for v in node.values()) + 1
    return 1


def python_calls() -> None:
    for _ in range(6):
        _walk(TREE)


class Commit:
    def __init__(self, where: str) -> None:
        self.conn = sqlite3.connect(os.path.join(where, "cold.db"), isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, state TEXT, record BLOB,"
                          " next_seq INT)")
        self.conn.execute("CREATE TABLE events (job_id TEXT, seq INT, data BLOB,"
                          " PRIMARY KEY (job_id, seq))")
        self.n = 0

    def __call__(self) -> None:
        self.n += 1
        job_id, c = f"job-{self.n}", self.conn
        c.execute("BEGIN IMMEDIATE")
        c.execute("SELECT next_seq FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        c.executemany("INSERT INTO events VALUES (?, ?, ?)",
                      [(job_id, seq, b"e" * 200) for seq in range(3)])
        c.execute("INSERT INTO jobs VALUES (?, ?, ?, ?)", (job_id, "setup", b"r" * 900, 4))
        c.execute("COMMIT")


def fork_exec() -> None:
    true = shutil.which("true") or "/bin/true"
    pid = os.posix_spawn(true, [true], os.environ)
    os.waitpid(pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--gaps", default="0,0.001,0.005,0.02,0.3")
    ap.add_argument("--dir", default=None, help="where the SQLite database goes")
    args = ap.parse_args()
    gaps = [float(g) for g in args.gaps.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        work = {"sqlite_commit": Commit(where), "python_calls": python_calls,
                "fork_exec": fork_exec}
        base: dict[str, float] = {}
        for name, fn in work.items():
            for gap in gaps:
                times = []
                for _ in range(args.samples + 2):  # the first two warm up
                    if gap:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t0) * 1e3)
                median = statistics.median(times[2:])
                base.setdefault(name, median)  # the first gap is the reference
                print(f"peer=host metric={name} value={median:.4f} unit=ms gap_s={gap:g} "
                      f"cold_x={median / base[name]:.2f} samples={args.samples} load1={load1()}")


if __name__ == "__main__":
    main()
