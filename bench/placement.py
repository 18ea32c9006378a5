"""Placement time per claim on a 256-thread two-way SMT host with 200 running claims.

Run: /tmp/venv/bin/python bench/placement.py [iterations]
Each iteration releases one random running job and places a new one (claim 1..8).
Prints median and p99 of place() in microseconds (and of release(), for reference).
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from motor.cpu.core import CpuPlacement
from motor.cpu.topology import Topology, allocatable


def run(iterations: int, avoid: frozenset[int], seed: int = 1) -> tuple[list[float], list[float], CpuPlacement]:
    rng = random.Random(seed)
    topo = Topology.synthetic(128, 2)  # 256 threads, cpu N and N+128 are siblings
    p = CpuPlacement(topo, allocatable(topo, None))
    running: list[str] = []
    for i in range(200):
        p.place(f"warm{i}", rng.randint(1, 8), avoid)
        running.append(f"warm{i}")
    place_us: list[float] = []
    release_us: list[float] = []
    clock = time.perf_counter_ns
    for i in range(iterations):
        victim = running.pop(rng.randrange(len(running)))
        t0 = clock()
        p.release(victim)
        t1 = clock()
        job = f"j{i}"
        claim = rng.randint(1, 8)
        t2 = clock()
        p.place(job, claim, avoid)
        t3 = clock()
        running.append(job)
        release_us.append((t1 - t0) / 1000)
        place_us.append((t3 - t2) / 1000)
    return place_us, release_us, p


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    print(f"256-thread two-way SMT host (254 allocatable), 200 running claims of 1..8, {iterations} iterations")
    windows = frozenset(range(96, 128)) | frozenset(range(224, 256))
    for label, avoid in (("no windows slot", frozenset()), ("windows slot active (64 cpus)", windows)):
        place_us, release_us, p = run(iterations, avoid)
        st = p.statistics()
        print(
            f"{label:32s} place: median {statistics.median(place_us):6.1f} us  p99 {p99(place_us):6.1f} us"
            f"  | release: median {statistics.median(release_us):5.1f} us  p99 {p99(release_us):5.1f} us"
            f"  | end state: {st.total_claims} claims on {st.allowed} cpus, max {st.max_claims} per cpu"
        )
    # An uncontended host: placement among free CPUs only.
    topo = Topology.synthetic(128, 2)
    p = CpuPlacement(topo, allocatable(topo, None))
    rng = random.Random(2)
    times = []
    for i in range(iterations):
        t0 = time.perf_counter_ns()
        p.place(f"f{i}", rng.randint(1, 8))
        t1 = time.perf_counter_ns()
        p.release(f"f{i}")
        times.append((t1 - t0) / 1000)
    print(f"{'empty host (all free)':32s} place: median {statistics.median(times):6.1f} us  p99 {p99(times):6.1f} us")


if __name__ == "__main__":
    main()
