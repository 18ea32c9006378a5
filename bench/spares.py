"""The start path of a cgroup v1 job through keeperd: spares against fork + join.

    python bench/spares.py [--n 30] [--rounds 3] [--gap-ms 60]

No runner. Each round opens keeperd on a temporary state dir with a cgroup backend on a
parent group of its own (`motor-bench-<pid>-<n>`, removed after), twice, interleaved:
`MOTOR_KEEPERD_SPARES=0` (peer=join: the keeper makes the job's groups from the spec and
its forked child joins them by a `cgroup.procs` write) and the default pool (DEFAULT_SIZE)
(peer=spares: a pre-placed thread in renamed groups spawns the job). Per job, spaced
`--gap-ms` apart (a join after an idle spell waits an RCU grace period: the case the
spares are for), one after another:

- `prepare` (ms): the runner's `backend.prepare` (the v1 plan: no mkdir, 3 stats, 1 read);
- `spawn` (ms): keeperd's spawn request until its answer, which comes once the job
  was spawned (or failed to be): the start path the join was on;
- `keeperd_cpu` (ms/job): keeperd's own utime+stime over the round, per job (the
  spares' refills included; the spares' own CPU is theirs, counted with the jobs).

Also `legacy_prepare` (ms): the same backend without `keeper_makes_groups` (3 mkdirs and
3 writes in the runner, as before the spares), for the runner's share. The first job
of a spares round has no spare yet and is left out of both peers' figures (n-1 each).
Needs root and cgroup v1 (cpuset, memory, cpuacct).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import load1

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from motor.execution import read_status, write_json_atomic  # noqa: E402
from motor.execution.keeperd_client import open_keeperd_spawner  # noqa: E402
from motor.execution.spares import DEFAULT_SIZE  # noqa: E402
from motor.isolation.cgroup import open_cgroup_backend  # noqa: E402
from private_cgroup import remove_private_parent  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def one_round(peer: str, n: int, gap: float, tag: str) -> dict[str, list[float]]:
    os.environ["MOTOR_KEEPERD_SPARES"] = "0" if peer == "join" else str(DEFAULT_SIZE)
    parent = f"motor-bench-{os.getpid()}-{tag}"
    backend = dataclasses.replace(open_cgroup_backend(parent=parent), keeper_makes_groups=True)
    legacy = open_cgroup_backend(parent=parent)
    out: dict[str, list[float]] = {"prepare": [], "spawn": [], "legacy_prepare": []}
    try:
        with tempfile.TemporaryDirectory(prefix="motor-spares-", ignore_cleanup_errors=True) as tmp:
            state = Path(tmp) / "state"
            (state / "jobs").mkdir(parents=True)
            async with open_keeperd_spawner(state) as spawner:
                kpid = spawner.keeperd_pid
                cpu0 = None
                for i in range(n):
                    job_id = f"b{i}"
                    t0 = time.perf_counter()
                    legacy.prepare(job_id + "-legacy", None, None)
                    t1 = time.perf_counter()
                    legacy.finish(job_id + "-legacy")
                    t2 = time.perf_counter()
                    fields = backend.prepare(job_id, None, None)
                    t3 = time.perf_counter()
                    job_dir = state / "jobs" / job_id
                    job_dir.mkdir()
                    write_json_atomic(job_dir / "spec.json", {
                        "job_id": job_id, "command": ["true"], "cwd": tmp,
                        "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                        "kill_grace_s": 1.0, **fields})
                    await trio.sleep(gap)  # an idle spell: the next migration waits a grace period
                    t4 = time.perf_counter()
                    handle = await spawner.spawn(job_dir)
                    t5 = time.perf_counter()
                    await spawner.wait_exit(handle.pid, handle.create_time, job_dir)
                    assert read_status(job_dir)["exit_code"] == 0
                    backend.finish(job_id)
                    if i == 0:
                        cpu0 = cpu_s(kpid)
                        continue
                    out["legacy_prepare"].append((t1 - t0) * 1000)
                    out["prepare"].append((t3 - t2) * 1000)
                    out["spawn"].append((t5 - t4) * 1000)
                out["keeperd_cpu"] = [(cpu_s(kpid) - cpu0) * 1000 / (n - 1)]
    finally:
        remove_private_parent(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=60.0)
    args = ap.parse_args()
    print(f"# spares: n={args.n} rounds={args.rounds} gap_ms={args.gap_ms} load1={load1()}", flush=True)
    meds: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for peer in ("join", "spares"):
            res = trio.run(one_round, peer, args.n, args.gap_ms / 1000, f"{r}{peer}")
            for metric, values in res.items():
                med = statistics.median(values)
                meds.setdefault((peer, metric), []).append(med)
                print(f"peer={peer} metric={metric} value={med:.3f} unit=ms samples={len(values)} "
                      f"min={min(values):.3f} max={max(values):.3f} load1={load1()}", flush=True)
    print(f"# medians over {args.rounds} rounds (ms), load1={load1()}")
    for (peer, metric), values in meds.items():
        print(f"# {peer:7} {metric:15} {statistics.median(values):8.3f}")


if __name__ == "__main__":
    main()
