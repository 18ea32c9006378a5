"""Benchmark: motor's read-only size walk against `du -s --block-size=1`.

Creates a tree of 200,000 small files in a temporary directory, then times the walk and du
on the same tree with a warm cache (one untimed warm-up, then --runs interleaved rounds, at
least 3; the best and the median are printed), their ratio, both byte totals and the load
average before and after.

    python bench/walk.py [--files N] [--runs K] [--dir PARENT]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time

from motor.disk.sizes import measure, mount_points


def build(root: str, files: int, per_dir: int = 500) -> None:
    for i in range(files):
        d = os.path.join(root, f"d{i // per_dir:05d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:07d}"), "wb") as f:
            f.write(b"x" * (i % 700 + 1))


def time_walk(root: str, mounts) -> tuple[float, float, int]:
    """(wall s, CPU s, bytes)."""
    t, c = time.perf_counter(), time.process_time()
    sizes = measure(root, mounts=mounts)
    return time.perf_counter() - t, time.process_time() - c, sizes.allocated_bytes


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_du(root: str) -> tuple[float, float, int]:
    """(wall s, CPU s of du, bytes)."""
    t, c = time.perf_counter(), _children_cpu()
    out = subprocess.run(["du", "-s", "--block-size=1", root], check=True, capture_output=True,
                         text=True).stdout
    return time.perf_counter() - t, _children_cpu() - c, int(out.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="parent of the temporary tree")
    args = ap.parse_args()
    args.runs = max(3, args.runs)
    root = tempfile.mkdtemp(prefix="motor-walk-bench-", dir=args.dir)
    try:
        t = time.perf_counter()
        build(root, args.files)
        print(f"tree: {args.files} files under {root} (built in {time.perf_counter() - t:.1f} s)")
        print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        mounts = mount_points()
        time_walk(root, mounts)  # warm the cache
        time_du(root)
        walks, dus, walk_cpu, du_cpu = [], [], [], []
        walk_bytes = du_bytes = 0
        for _ in range(args.runs):
            s, c, walk_bytes = time_walk(root, mounts)
            walks.append(s)
            walk_cpu.append(c)
            s, c, du_bytes = time_du(root)
            dus.append(s)
            du_cpu.append(c)
        bw, bd = min(walks), min(dus)
        print(f"motor walk: best {bw:.3f} s, median {statistics.median(walks):.3f} s, "
              f"{walk_bytes} bytes")
        print(f"du -s     : best {bd:.3f} s, median {statistics.median(dus):.3f} s, "
              f"{du_bytes} bytes")
        print(f"ratio walk/du (best): {bw / bd:.2f}x; "
              f"(median): {statistics.median(walks) / statistics.median(dus):.2f}x; "
              f"totals {'equal' if walk_bytes == du_bytes else 'DIFFER'}")
        mw, md = statistics.median(walk_cpu), statistics.median(du_cpu)
        print(f"CPU (median): walk {mw:.3f} s, du {md:.3f} s, ratio {mw / md:.2f}x "
              "(less sensitive to other load than wall time)")
        print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
