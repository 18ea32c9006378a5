"""CPU the keeper side spends per job: keeperd against forkserver + per-job keepers.

    python bench/keeper_cpu.py [--n 200] [--rounds 3] [--cgroup-procs]

No runner: each round opens a spawner on a temporary state dir (open_spawner, mode
"keeperd" or "forkserver", interleaved), spawns N jobs of `true` one after another and waits
for each job's status. It reads /proc/<pid>/stat of the keeper-side process before and
after:

- keeperd: its utime + stime (the jobs it reaps land in its cutime, not counted);
- forkserver: its utime + stime, plus cutime + cstime (the keepers it reaped, and the
  jobs they reaped) less the jobs' own CPU (the sum of status.json `cpu_time_ms`).

`--cgroup-procs` gives each job a (plain file) cgroup_procs entry, so keeperd takes its
fork+exec path instead of posix_spawn. Prints one line per measurement and the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from motor.execution import open_spawner, read_status, wait_process_exit, write_json_atomic  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of pid, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    ut, st, cut, cst = (int(x) for x in fields[11:15])
    return (ut + st) / TICK, (cut + cst) / TICK


async def one_round(mode: str, n: int, cgroup_procs: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="motor-kcpu-") as tmp:
        state = Path(tmp) / "state"
        (state / "jobs").mkdir(parents=True)
        procs = Path(tmp) / "procs"
        procs.write_text("")

        def job(i: int) -> Path:
            d = state / "jobs" / f"j{i}"
            d.mkdir()
            spec = {"job_id": f"j{i}", "command": ["true"], "cwd": tmp, "env": {"PATH": "/usr/bin:/bin"},
                    "timeout_s": 60.0}
            if cgroup_procs:
                spec["cgroup_procs"] = [str(procs)]
            write_json_atomic(d / "spec.json", spec)
            return d

        async with open_spawner(mode=mode, state_dir=state) as sp:
            d = job(-1)
            h = await sp.spawn(d)  # warm: keeperd / forkserver up
            await sp.wait_exit(h.pid, h.create_time, d) if mode == "keeperd" else \
                await wait_process_exit(h.pid, h.create_time)
            server = h.pid if mode == "keeperd" else sp.forkserver_pid
            own0, kids0 = cpu_s(server)
            t0 = time.perf_counter()
            dirs = []
            for i in range(n):
                d = job(i)
                h = await sp.spawn(d)
                if mode == "keeperd":
                    await sp.wait_exit(h.pid, h.create_time, d)
                else:
                    await wait_process_exit(h.pid, h.create_time)
                dirs.append(d)
            wall = time.perf_counter() - t0
            if mode == "forkserver":  # the last keeper is reaped by the forkserver's loop
                deadline = time.monotonic() + 5
                while cpu_s(server)[1] == kids0 and time.monotonic() < deadline:
                    await trio.sleep(0.01)
                await trio.sleep(0.05)
            own1, kids1 = cpu_s(server)
        jobs_cpu = sum(read_status(d)["cpu_time_ms"] for d in dirs) / 1000
        if mode == "keeperd":
            keeper = own1 - own0
        else:
            keeper = (own1 - own0) + (kids1 - kids0) - jobs_cpu
        return keeper / n * 1000, wall / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cgroup-procs", action="store_true")
    args = ap.parse_args()
    res: dict[str, list[tuple[float, float]]] = {"keeperd": [], "forkserver": []}
    for _ in range(args.rounds):
        for mode in ("forkserver", "keeperd"):
            cpu, wall = trio.run(one_round, mode, args.n, args.cgroup_procs)
            res[mode].append((cpu, wall))
            print(f"peer=motor-{mode} metric=keeper_cpu_per_job value={cpu:.3f} unit=ms "
                  f"n={args.n} spawn_to_status_ms={wall:.3f} cgroup_procs={args.cgroup_procs} "
                  f"load1={os.getloadavg()[0]:.2f}", flush=True)
    for mode, vals in res.items():
        print(f"# {mode:<10} keeper CPU/job median {statistics.median(v[0] for v in vals):.3f} ms, "
              f"spawn->status median {statistics.median(v[1] for v in vals):.3f} ms")


if __name__ == "__main__":
    main()
