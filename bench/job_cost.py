"""The runner's own CPU per job, steadier than wall figures on a shared host.

    python bench/job_cost.py [--rounds 3] [--n 200] [--isolation affinity] [--baseline-root DIR]
                             [--command 'true']

Each round runs an embedded runner (`motor.open_runner`, `max_weight=2`, claims of 1, jobs of
`true` (or `--command`) over 4 workspaces, as bench/throughput.py submits them, without the
HTTP layer) in a fresh process, submits N jobs, waits for every job's terminal event and
prints, in the peers' line format:

- `runner_cpu_per_job` (ms): user+system CPU of the runner's process (its event loop and
  its worker threads; keeperd and the jobs are other processes) from the first submit to
  the last terminal event, over N;
- `keeperd_cpu_per_job` (ms, when keeperd is the spawner): the same for the runner's
  keeperd (/proc/PID/stat; the jobs it reaps are not in it), and `host_cpu_per_job` (ms):
  the whole host's busy CPU over that span (/proc/stat: the runner, keeperd, the jobs,
  the kernel's workers and anything else that ran);
- `embedded_throughput_wall` (s), with `jobs_per_s`.

`--baseline-root DIR` runs the same rounds, interleaved, with the motor package found in
DIR (e.g. `git archive REV | tar -x -C DIR`), as peer=motor-baseline. Every line carries
the 1-minute load average (load1=); the end shows the medians over rounds.
"""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

from benchlib import BURST, ab_parser, fs_note, load1, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent

ROUND = BURST + r"""
import json, resource, sys, time
import trio

iso, n, command = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
sys.path.append(sys.argv[4])  # this checkout's bench/, whichever tree's motor runs here
from benchlib import host_busy_s, process_cpu_s

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def main():
    async with warm_runner(iso, n + 10) as runner:
        keeperd = getattr(getattr(runner, "spawner", None), "keeperd_pid", None)
        k0 = process_cpu_s(keeperd) if keeperd else None
        c0, h0, t0 = cpu(), host_busy_s(), time.perf_counter()
        ids = await burst(runner, n, command)
        states = [(await runner.get(job_id)).state for job_id in ids]
        c1, h1, t1 = cpu(), host_busy_s(), time.perf_counter()
        k1 = process_cpu_s(keeperd) if keeperd else None
    bad = [s for s in states if s != "succeeded"]
    print(json.dumps({"cpu_s": c1 - c0, "wall_s": t1 - t0, "host_s": h1 - h0,
                      "keeperd_s": None if k0 is None else k1 - k0, "bad": bad[:3]}))

trio.run(main)
"""


def one_round(root: Path, iso: str, n: int, command: list[str]) -> dict:
    got = run_round(ROUND, root, iso, str(n), json.dumps(command), str(Path(__file__).parent))
    if got["bad"]:
        raise SystemExit(f"jobs did not succeed in {root}: {got['bad']}")
    return got


def main() -> None:
    ap = ab_parser(__doc__, rounds=3)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--command", default="true",
                    help="each job's command (split like a shell would), e.g. 'echo hi'")
    args = ap.parse_args()
    fs_note()
    peers = bench_peers(ROOT, args.baseline_root)
    cpu: dict[str, list[float]] = {p: [] for p, _ in peers}
    rate: dict[str, list[float]] = {p: [] for p, _ in peers}
    others: dict[str, dict[str, list[float]]] = {p: {"keeperd": [], "host": []} for p, _ in peers}
    print(f"# job_cost: rounds={args.rounds} n={args.n} isolation={args.isolation} "
          f"command={args.command!r} load1={load1()}", flush=True)
    for _ in range(args.rounds):
        for peer, root in peers:
            got = one_round(root, args.isolation, args.n, shlex.split(args.command))
            per_job_ms = 1000 * got["cpu_s"] / args.n
            cpu[peer].append(per_job_ms)
            rate[peer].append(args.n / got["wall_s"])
            print(f"peer={peer} metric=runner_cpu_per_job value={per_job_ms:.3f} unit=ms "
                  f"n={args.n} slots=2 isolation={args.isolation} load1={load1()}", flush=True)
            for what, key in (("keeperd", "keeperd_s"), ("host", "host_s")):
                if got.get(key) is not None:
                    others[peer][what].append(1000 * got[key] / args.n)
                    print(f"peer={peer} metric={what}_cpu_per_job value="
                          f"{others[peer][what][-1]:.3f} unit=ms n={args.n} slots=2 "
                          f"isolation={args.isolation} load1={load1()}", flush=True)
            print(f"peer={peer} metric=embedded_throughput_wall value={got['wall_s']:.4f} unit=s "
                  f"n={args.n} slots=2 jobs_per_s={args.n / got['wall_s']:.1f} "
                  f"isolation={args.isolation} load1={load1()}", flush=True)
    print(f"# medians over {args.rounds} rounds, load1={load1()}")
    for peer, _ in peers:
        more = "".join(f"   {what} {statistics.median(v):.3f} ms"
                       for what, v in others[peer].items() if v)
        print(f"# {peer:15s} runner_cpu_per_job {statistics.median(cpu[peer]):8.3f} ms   "
              f"{statistics.median(rate[peer]):7.1f} jobs/s{more}")
    if args.baseline_root:
        print(f"# runner CPU per job, motor / motor-baseline: "
              f"{statistics.median(cpu['motor']) / statistics.median(cpu['motor-baseline']):.2f}x")


if __name__ == "__main__":
    main()
