"""The runner's work per job and per request, counted rather than timed.

    python bench/work_counts.py [--n 300] [--requests 500] [--isolation affinity]
                                [--baseline-root DIR]

On a shared host CPU and wall figures of one change spread by more than the change (stop 22
saw rounds of one set read 2.4-3.4 ms of CPU per job); counts of the work do not. Each
figure comes from a fresh process, in the peers' line format:

- embedded (`motor.open_runner`, `max_weight=2`, N `true` jobs of claim 1 over 4 workspaces,
  submitted together as bench/job_cost.py does): `python_calls_per_job` (cProfile's total
  of Python function calls, C functions included), `task_steps_per_job` and
  `loop_iterations_per_job` (trio's instrument: task steps, I/O waits of the event loop);
- through a real `motor serve` on its Unix socket, one kept-alive client, cProfile running
  in the runner only between two signals: `python_calls_per_request` and
  `loop_iterations_per_request` (cProfile's count of `epoll.poll`) for `GET /`,
  `GET /v1/health` and a `POST /v1/jobs` that queues (a `sleep` job holds the capacity),
  each `--requests` times (`request=`); and `python_calls_per_job` and
  `loop_iterations_per_job` for 200 `true` jobs submitted one request each and run to the
  end (`via=http`).

`--baseline-root DIR` measures the motor package found in DIR (e.g. `git archive REV |
tar -x -C DIR`) the same way, as peer=motor-baseline, and the end prints each figure's
ratio. cProfile adds its own cost to every call, so these are counts, not times: compare
them only with counts. Every line carries load1=.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BURST, ab_parser, load1, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent

EMBEDDED = BURST + r"""
import cProfile, json, pstats, sys
import trio

iso, n = sys.argv[1], int(sys.argv[2])

class Count(trio.abc.Instrument):
    steps = io = 0
    def before_task_step(self, task): Count.steps += 1
    def before_io_wait(self, timeout): Count.io += 1

async def main(prof):
    async with warm_runner(iso, n + 10) as runner:
        count = Count()
        trio.lowlevel.add_instrument(count)
        prof.enable()
        await burst(runner, n)
        prof.disable()
        trio.lowlevel.remove_instrument(count)
        return count

prof = cProfile.Profile()
count = trio.run(main, prof)
calls = pstats.Stats(prof).total_calls - count.steps - count.io  # not the instrument's own
print(json.dumps({"python_calls_per_job": calls / n, "task_steps_per_job": count.steps / n,
                  "loop_iterations_per_job": count.io / n}))
"""

#: `motor serve` with cProfile switched on by SIGUSR2 and off (and dumped to $PROF) by SIGUSR1
SERVE = ("import os, signal, sys, cProfile\n"
         "prof = cProfile.Profile()\n"
         "signal.signal(signal.SIGUSR2, lambda *a: prof.enable())\n"
         "signal.signal(signal.SIGUSR1, lambda *a: (prof.disable(), prof.dump_stats(os.environ['PROF'])))\n"
         "sys.argv = ['motor', 'serve', *sys.argv[1:]]\n"
         "from motor.cli import main\n"
         "main()\n")


GROUPS = ("/sys/fs/cgroup/*/motor-jobs/job-*", "/sys/fs/cgroup/motor-jobs/job-*")


def _job_groups() -> set[str]:
    import glob

    return {d for pattern in GROUPS for d in glob.glob(pattern)}


def _remove_new_groups(before: set[str]) -> None:
    """The job groups a round left (a runner stopped before it removed a finished job's
    groups leaves them for its next start to sweep; a round's state dir has none): removed
    once empty, so the bench leaves the host as it found it."""
    deadline = time.monotonic() + 10
    for d in sorted(_job_groups() - before):
        while time.monotonic() < deadline:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:  # a job still ending in it
                time.sleep(0.05)


def _counts(profile: str) -> tuple[int, int]:
    import pstats

    stats = pstats.Stats(profile)
    polls = sum(v[1] for k, v in stats.stats.items() if k[2] == "<method 'poll' of 'select.epoll' objects>")
    return stats.total_calls, polls


def _serve_round(root: Path, isolation: str, what: str, requests: int) -> dict:
    """One `motor serve` from `root`; the counts of `what` ("/", "/v1/health", "submit",
    "jobs")."""
    import httpx

    sys.path.insert(0, str(ROOT))
    from motor.execution.spawner import cancel_keepers_under

    groups = _job_groups()
    with tempfile.TemporaryDirectory() as tmp:
        state, prof = Path(tmp) / "state", Path(tmp) / "serve.prof"
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "--state-dir", str(state), "--free-space-floor-bytes", "0",
             "--isolation", isolation, "--max-weight", "2", "--max-queue-depth", str(requests + 300)],
            env=dict(os.environ, PYTHONPATH=str(root), PROF=str(prof)), cwd=root,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sock = state / "motor.sock"
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"serve from {root} did not start")
                time.sleep(0.02)
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://motor",
                              timeout=60) as c:
                def job(i: int) -> dict:
                    return {"command": ["true"], "weight_hint": 1, "workspace": f"ws{i % 4}"}

                if what == "submit":
                    c.post("/v1/jobs", json={"command": ["sleep", "600"], "weight_hint": 2,
                                             "workspace": "blocker"}).raise_for_status()
                for i in range(20):  # warm: imports, caches, the first connection
                    if what == "submit":
                        c.post("/v1/jobs", json=job(i))
                    else:
                        c.get("/v1/health")
                if what == "jobs":
                    wait_idle(c)
                n = 200 if what == "jobs" else requests
                proc.send_signal(signal.SIGUSR2)
                time.sleep(0.2)
                for i in range(n):
                    if what in ("submit", "jobs"):
                        r = c.post("/v1/jobs", json=job(i))
                        if r.status_code != 202:
                            raise SystemExit(f"submit: {r.status_code} {r.text}")
                    else:
                        c.get(what).raise_for_status()
                if what == "jobs":
                    wait_idle(c)
                proc.send_signal(signal.SIGUSR1)
                deadline = time.monotonic() + 30
                while not prof.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.3)  # the dump is written whole before the next read
        finally:
            proc.terminate()  # queued jobs stay unstarted; the blocker outlives its runner:
            proc.wait(60)
            cancel_keepers_under(state)  # ended here
            _remove_new_groups(groups)
        calls, polls = _counts(str(prof))
        unit = "job" if what == "jobs" else "request"
        return {f"python_calls_per_{unit}": calls / n, f"loop_iterations_per_{unit}": polls / n}


def wait_idle(c) -> None:
    while True:
        status = c.get("/v1/status").json()
        if not status["queued"] and not status["running"]:
            return
        time.sleep(0.05)


def main() -> None:
    ap = ab_parser(__doc__)
    ap.add_argument("--n", type=int, default=300, help="embedded jobs (default 300)")
    ap.add_argument("--requests", type=int, default=500, help="requests of each kind (default 500)")
    args = ap.parse_args()
    peers = bench_peers(ROOT, args.baseline_root)
    results: dict[tuple[str, str], dict] = {}
    print(f"# work_counts: n={args.n} requests={args.requests} isolation={args.isolation} load1={load1()}",
          flush=True)
    for peer, root in peers:
        groups = _job_groups()
        got = run_round(EMBEDDED, root, args.isolation, str(args.n))
        _remove_new_groups(groups)
        results[(peer, "embedded")] = got
        for metric, value in got.items():
            print(f"peer={peer} metric={metric} value={value:.1f} unit=count via=embedded "
                  f"n={args.n} isolation={args.isolation} load1={load1()}", flush=True)
        for what in ("/", "/v1/health", "submit", "jobs"):
            got = _serve_round(root, args.isolation, what, args.requests)
            results[(peer, what)] = got
            tag = "via=http n=200" if what == "jobs" else f"request={what} n={args.requests}"
            for metric, value in got.items():
                print(f"peer={peer} metric={metric} value={value:.1f} unit=count {tag} "
                      f"isolation={args.isolation} load1={load1()}", flush=True)
    if len(peers) > 1:
        print("# motor / motor-baseline")
        for (peer, what), got in results.items():
            if peer != "motor":
                continue
            base = results[("motor-baseline", what)]
            for metric, value in got.items():
                print(f"# {what:12s} {metric:28s} {value:9.1f} / {base[metric]:9.1f} = {value / base[metric]:.3f}")


if __name__ == "__main__":
    main()
