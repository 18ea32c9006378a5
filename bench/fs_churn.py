"""What a file creation costs on ext4 right after many deletions, with and without a journal.

    python bench/fs_churn.py [--jobs 2000] [--rounds 3] [--size-mb 256]   (root: loop mounts)

Each round makes two ext4 file systems in image files (`mkfs.ext4`, one with `-O
^has_journal`), loop-mounts them, and on each times what a job's files cost: per "job" a
directory with five small files in it (a job directory, spec.json, keeper.json, status.json,
output.log), `--jobs` of them:

- `create_fresh` (us per file or directory, CPU of this process: user + system): on the
  new file system;
- `create_after_delete`: again, 1.5 s after the first set was deleted (`rm -r`, as a
  retention pass removes job directories; ext4 passes over an inode freed in an earlier
  second, not one freed in the current one).

On ext4 without a journal the inode allocator skips every inode freed in the last 60-300 s
(fs/ext4/ialloc.c, `recently_deleted()`, called only when there is no journal), so the second
figure is what job starts and ends cost for minutes after a retention pass there
(docs/performance.md, "The host's file system"; motor/disk/fsinfo.py). Printed in the peers'
line format with the load average; the end shows the medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import load1

FILES = ("spec.json", "keeper.json", "status.json", "output.log", "events")


def make_jobs(root: Path, tag: str, n: int) -> float:
    """CPU seconds per created inode for n job directories of len(FILES) files each."""
    data = b'{"x": 1}\n' * 16
    c0 = time.process_time()
    for i in range(n):
        d = root / f"{tag}{i}"
        os.mkdir(d)
        for name in FILES:
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
    return (time.process_time() - c0) / (n * (1 + len(FILES)))


def one_round(tmp: Path, journal: bool, jobs: int, size_mb: int) -> tuple[float, float]:
    mnt, image = tmp / ("j" if journal else "nj"), tmp / ("j.img" if journal else "nj.img")
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", str(jobs * 16),
                    *([] if journal else ["-O", "^has_journal"]), str(image)],
                   check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True)
    try:
        fresh = make_jobs(mnt, "a", jobs)
        for i in range(jobs):
            shutil.rmtree(mnt / f"a{i}")
        time.sleep(1.5)  # ext4 skips an inode freed before this second, not during it
        after = make_jobs(mnt, "b", jobs)
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
        image.unlink(missing_ok=True)
    return fresh * 1e6, after * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mb", type=int, default=256)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        print("# fs_churn: needs root and mkfs.ext4 (loop mounts); skipped")
        return 0
    results: dict[str, list[tuple[float, float]]] = {"journal": [], "no-journal": []}
    for _ in range(args.rounds):
        for journal in (True, False):
            with tempfile.TemporaryDirectory(prefix="motor-fschurn-", dir="/var/tmp") as tmp:
                fresh, after = one_round(Path(tmp), journal, args.jobs, args.size_mb)
            name = "journal" if journal else "no-journal"
            results[name].append((fresh, after))
            for metric, value in (("create_fresh", fresh), ("create_after_delete", after)):
                print(f"peer=ext4-{name} metric={metric} value={value:.1f} unit=us "
                      f"jobs={args.jobs} files_per_job={1 + len(FILES)} load1={load1()}", flush=True)
    for name, vals in results.items():
        print(f"# ext4-{name:<10} create_fresh {statistics.median(v[0] for v in vals):.1f} us, "
              f"create_after_delete {statistics.median(v[1] for v in vals):.1f} us "
              f"(CPU per created inode, medians of {len(vals)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
