"""Benchmark: motor's read-only size walk against `du -s --block-size=1`.

Creates a tree of 200,000 small files in a temporary directory, then times on the same warm
tree, in interleaved rounds (one untimed warm-up, then --runs rounds, at least 3): `du`, the
walk as motor runs it (`measure`: the native ctypes `fstatat` walk where this machine has
it), the `os.stat` walk (`measure(fast=False)`, the fallback), and optionally the walk of
another version (`--baseline FILE`: a sizes.py, e.g. from
`git show <commit>:motor/disk/sizes.py > /tmp/old_sizes.py`). Prints each one's median and
best wall time and median CPU time, the ratios to du's medians, the byte totals and the load
average before and after. Wall time is what the goal (<= 1.5x du) is about; CPU time is less
sensitive to other load on the machine.

    python bench/walk.py [--files N] [--runs K] [--dir PARENT] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from motor.disk.sizes import measure, mount_points, native


def build(root: str, files: int, per_dir: int = 500) -> None:
    for i in range(files):
        d = os.path.join(root, f"d{i // per_dir:05d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:07d}"), "wb") as f:
            f.write(b"x" * (i % 700 + 1))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(fn) -> tuple[float, float, int]:
    """(wall s, CPU s of this process and its children, bytes)."""
    t, c = time.perf_counter(), time.process_time() + _children_cpu()
    n = fn()
    return time.perf_counter() - t, time.process_time() + _children_cpu() - c, n


def du(root: str) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", root], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[0])


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("motor_walk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="parent of the temporary tree")
    ap.add_argument("--baseline", default=None, help="a sizes.py of another version to time too")
    args = ap.parse_args()
    args.runs = max(3, args.runs)
    root = tempfile.mkdtemp(prefix="motor-walk-bench-", dir=args.dir)
    try:
        t = time.perf_counter()
        build(root, args.files)
        print(f"tree: {args.files} files under {root} (built in {time.perf_counter() - t:.1f} s)")
        print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
        mounts = mount_points()
        print(f"motor walk: {'native fstatat' if native() else 'os.stat (no native layout)'}")
        contenders = {
            "du -s": lambda: du(root),
            "motor walk": lambda: measure(root, mounts=mounts).allocated_bytes,
            "os.stat walk": lambda: measure(root, mounts=mounts, fast=False).allocated_bytes,
        }
        if args.baseline:
            old = load_baseline(args.baseline)
            contenders["baseline"] = lambda: old.measure(root, mounts=mounts).allocated_bytes
        for fn in contenders.values():  # warm the cache
            fn()
        wall = {k: [] for k in contenders}
        cpu = {k: [] for k in contenders}
        totals = {}
        for _ in range(args.runs):
            for name, fn in contenders.items():
                w, c, totals[name] = timed(fn)
                wall[name].append(w)
                cpu[name].append(c)
        dw, dc = statistics.median(wall["du -s"]), statistics.median(cpu["du -s"])
        for name in contenders:
            mw, mc = statistics.median(wall[name]), statistics.median(cpu[name])
            print(f"{name:13s}: wall median {mw:.3f} s (best {min(wall[name]):.3f} s), "
                  f"{mw / dw:.2f}x du; CPU median {mc:.3f} s, {mc / dc:.2f}x du; "
                  f"{totals[name]} bytes")
        same = len(set(totals.values())) == 1
        print(f"{args.runs} rounds; totals {'equal' if same else 'DIFFER'}")
        print("load average: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
