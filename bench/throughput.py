"""Overhead per job: N jobs of `true` through a real `motor serve`, beside peers.

    python bench/throughput.py [--n 200] [--rounds 3] [--isolation affinity] [--no-peers]
                               [--systemd-namespace] [--cli] [--spawners keeperd,forkserver]

`--spawners` runs the motor rounds once per named spawner (MOTOR_SPAWNER, docs/keeper.md),
interleaved within each round, printed as peer=motor-<spawner> (motor-batch-<spawner>, ...).

`--systemd-namespace` runs each round's runner inside a real systemd that is PID 1 of its
own namespaces (tests/isolation/systemd_ns.py; root, cgroup v1 hosts), for
`--isolation systemd` where the host's PID 1 is not systemd.

Each round starts a runner (`--max-weight 2`, claims of 1, jobs spread over 4 workspaces),
submits N jobs of `true` through the HTTP API on the Unix socket one after another, and
measures the wall time from the first submit until every job has ended (every job is
then checked to have succeeded), and the host's CPU over the same span (/proc/stat: every
process's, the runner's, keeperd's, the jobs' and the client's; for a peer, while its
script runs), printed per job as `host_cpu_per_job_ms` and beside the medians: on two
CPUs a rate above 2000 / that figure jobs/s cannot be reached however the work overlaps.
A motor line also carries the runner's own process's CPU per job
(`runner_cpu_per_job_ms`, beside the medians as "runner's own") and its keeperd's
(`keeperd_cpu_per_job_ms`, when keeperd is the spawner), /proc/PID/stat over the same
span: the part that is motor's, whatever the host's other processes did meanwhile (not
with `--systemd-namespace`). The motor lines also carry the time the runner and keeperd
waited runnable for a CPU (`runner_wait_per_job_ms`, `keeperd_wait_per_job_ms`:
/proc/PID/task/*/schedstat) and, when this script's own process submitted the jobs, its
CPU per job (`client_cpu_per_job_ms`); with task-spooler in the run the end prints the
budget its rate leaves the runner: on two CPUs 2000 / its jobs/s ms of host CPU per job,
less what motor's other processes took (the host's CPU per job less the runner's).
The end is waited for as task-spooler's is (`tsp -w`): by following an unfinished job's
event stream to its end, then asking `GET /v1/status` whether any is left (up to stop 20
this script polled `GET /v1/status` every 2 ms, a load of its own on the runner;
`--poll-status` adds that as peer=motor-poll). In the same round, interleaved, it runs
the peers' scripts from ../shared/bench/peers (`throughput.sh bare-xargs` and `throughput.sh tsp`;
`setup.sh` must have run for tsp). It prints one line per measurement in the peers'
format and, at the end, the medians, jobs/s and ratios.

Each round also runs a fresh runner for peer=motor-client: the same N requests one after
another, sent by motor's own client (`motor.client.Client`, the CLI's transport, which keeps
its connection between requests since stop 30) instead of httpx; and one for peer=motor-batch: the same N jobs submitted in ONE
batch request (`POST /v1/jobs` with a JSON list, docs/protocol.md). Both motor lines carry
`submit_s` (first submit until the last job is accepted) and `submit_jobs_per_s`; the
medians end with the submit rate of one batch against one request per job.

`--backend-pairs N` measures the row "systemd backend >= cgroup backend" instead: N pairs of
fresh runners, one `--isolation systemd` inside a systemd namespace and one `--isolation
cgroup` on the host, each running the N jobs one request each (as peer=motor), the order
within a pair alternated; then the medians, their ratio and in how many pairs systemd was
ahead. The two are at parity within a noise of about +-15% per 100-job burst
(docs/performance-history.md, "Stop 65"), so the row needs many pairs.

`--cli` adds what a CI script sees: peer=motor-cli-each submits the N jobs with one
`motor submit -- true` process each, peer=motor-cli-from with one `motor submit --from -`
(JSON lines on stdin).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchlib import (
    PEERS, ended_jobs, fs_note, host_busy_s, motor_serve, process_cpu_s, sched_s, socket_of,
)

ROOT = Path(__file__).resolve().parent.parent


def emit(peer: str, wall: float, n: int, extra: str = "") -> None:
    print(f"peer={peer} metric=throughput_wall value={wall:.6f} unit=s n={n} slots=2 "
          f"jobs_per_s={n / wall:.1f}{' ' + extra if extra else ''}", flush=True)


def wait_idle(c: httpx.Client, poll: bool) -> None:
    """Until no job is queued or running. By default it follows one unfinished job's event
    stream to its end (a blocking read, as the peers' script waits with `tsp -w`) and looks
    again: a few requests in all. `poll`: `GET /v1/status` every 2 ms, as this script did
    up to stop 20 (peer=motor-poll, `--poll-status`): hundreds of status requests during a
    round, each the runner's work too."""
    while True:
        status = c.get("/v1/status").json()
        left = status["running"] + status["queued"]
        if not left:
            return
        if poll:
            time.sleep(0.002)
            continue
        with c.stream("GET", f"/v1/jobs/{left[-1]['job_id']}/events") as r:
            for _ in r.iter_lines():
                pass


def motor_round(n: int, isolation: str, systemd_namespace: bool = False,
                mode: str = "api", spawner: str | None = None, own: dict | None = None
                ) -> tuple[float, float, float]:
    """(wall until all N ended, wall until all N were accepted, the host's busy CPU seconds
    over the same span: `host_busy_s`); `own`, when given, gets the CPU seconds of the
    runner's own process ("runner") and of its keeperd ("keeperd") over that span, the
    seconds each waited runnable for a CPU ("runner_wait", "keeperd_wait": `sched_s`; not
    in a systemd namespace, whose runner is not this process's child) and, when the jobs
    are submitted from this process, its own CPU seconds ("client"); `mode`: "api" (one request
    per job, httpx), "api-client" (one request per job, motor.client.Client), "api-poll" (the same, waiting with status polls), "batch" (one batch request),
    "cli-each" (one `motor submit` process per job), "cli-from" (one `motor submit --from -`)."""
    env = {**os.environ, "MOTOR_SPAWNER": spawner} if spawner else None
    with tempfile.TemporaryDirectory(prefix="motor-bench-") as tmp, motor_serve(
            Path(tmp), ROOT, "--max-weight", "2", "--max-queue-depth", str(n + 10),
            "--free-space-floor-bytes", "0", "--isolation", isolation,
            namespace=systemd_namespace, env=env) as serve:
        sock = socket_of(serve)
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://motor", timeout=60) as c:
            c.get("/v1/health").raise_for_status()
            jobs = [{"command": ["true"], "weight_hint": 1, "workspace": f"ws{i % 4}"} for i in range(n)]
            procs = {} if own is None or systemd_namespace else _own_processes(serve)
            own0 = {name: process_cpu_s(pid) for name, pid in procs.items()}
            waits0 = {name: sched_s(pid)[1] for name, pid in procs.items()}
            client0 = time.process_time()
            busy0, t0 = host_busy_s(), time.perf_counter()
            cli = [sys.executable, "-m", "motor", "submit", "--socket", str(sock)]
            if mode == "batch":
                r = c.post("/v1/jobs", json=jobs)
                refused = [a for a in r.json() if a.get("refused")] if r.status_code == 200 else None
                if refused != []:
                    raise SystemExit(f"batch submit: {r.status_code} {refused or r.text}")
            elif mode == "cli-from":
                lines = "".join(json.dumps(job) + "\n" for job in jobs).encode()
                r = subprocess.run(cli + ["--from", "-"], input=lines, capture_output=True, cwd=ROOT)
                if r.returncode != 0 or len(r.stdout.splitlines()) != n:
                    raise SystemExit(f"submit --from: exit {r.returncode}: {r.stderr.decode()[-500:]}")
            elif mode == "cli-each":
                for i, job in enumerate(jobs):
                    r = subprocess.run(cli + ["--weight", "1", "--workspace", job["workspace"], "--", "true"],
                                       capture_output=True, cwd=ROOT)
                    if r.returncode != 0:
                        raise SystemExit(f"submit {i}: exit {r.returncode}: {r.stderr.decode()[-500:]}")
            elif mode == "api-client":
                from motor.client import Client  # this checkout's (the runner: the cwd's)

                with Client(sock, timeout=60) as mc:
                    for job in jobs:
                        mc.submit(job, raw=True)
            else:
                for i, job in enumerate(jobs):
                    r = c.post("/v1/jobs", json=job)
                    if r.status_code != 202:
                        raise SystemExit(f"submit {i}: {r.status_code} {r.text}")
            t_sub = time.perf_counter()
            wait_idle(c, poll=mode == "api-poll")
            t1, busy1 = time.perf_counter(), host_busy_s()
            if own is not None:
                own.update({name: process_cpu_s(pid) - own0[name] for name, pid in procs.items()})
                own.update({f"{name}_wait": sched_s(pid)[1] - waits0[name]
                            for name, pid in procs.items()})
                if mode in ("api", "api-client", "api-poll", "batch"):  # this process's
                    own["client"] = time.process_time() - client0
            jobs = ended_jobs(sock)
            ok = sum(1 for j in jobs if j.state == "succeeded")
            if ok != n:
                bad = [(j.state, j.reason, j.detail) for j in jobs if j.state != "succeeded"]
                raise SystemExit(f"only {ok} of {n} jobs succeeded; the others: {bad[:3]}")
        return t1 - t0, t_sub - t0, busy1 - busy0


def _own_processes(serve) -> dict[str, int]:
    """The runner's pid and its keeperd's (detached, found by the state directory on its
    command line; absent when the spawner is another)."""
    import psutil

    found, state = {"runner": serve.proc.pid}, os.path.realpath(serve.state)
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if len(cmd) > 1 and cmd[-2].endswith("keeperd.py") and os.path.realpath(cmd[-1]) == state:
            found["keeperd"] = p.pid
    return found


def peer_round(peer: str, n: int) -> tuple[float, float] | None:
    """(the peer's wall, the host's busy CPU seconds while its script ran: a little more
    than its timed part, the script's own start and check included)."""
    script = PEERS / "throughput.sh"
    if not script.exists():
        return None
    busy0 = host_busy_s()
    r = subprocess.run(["bash", str(script), peer, str(n)], capture_output=True, text=True)
    busy = host_busy_s() - busy0
    if r.returncode != 0:
        print(f"# {peer}: {r.stderr.strip() or r.stdout.strip()}", flush=True)
        return None
    line = r.stdout.strip().splitlines()[-1]
    print(f"{line} host_cpu_per_job_ms={busy / n * 1e3:.2f}", flush=True)
    fields = dict(kv.split("=", 1) for kv in line.split())
    return float(fields["value"]), busy


def backend_pairs(pairs: int, n: int) -> None:
    """`--backend-pairs`: systemd (namespace) against cgroup (host), fresh runners, one
    request per job, the order within each pair alternated."""
    rates: dict[str, list[float]] = {"systemd": [], "cgroup": []}
    for i in range(pairs):
        order = [("systemd", True), ("cgroup", False)]
        for isolation, namespace in (order if i % 2 == 0 else order[::-1]):
            wall, _, _ = motor_round(n, isolation, namespace)
            emit(f"motor-{isolation}", wall, n, f"pair={i + 1} isolation={isolation} "
                                                f"load1={os.getloadavg()[0]:.2f}")
            rates[isolation].append(n / wall)
    s, c = (statistics.median(rates[k]) for k in ("systemd", "cgroup"))
    ahead = sum(a > b for a, b in zip(rates["systemd"], rates["cgroup"]))
    print(f"# medians of {pairs} pairs: systemd {s:.1f} jobs/s, cgroup {c:.1f} jobs/s, "
          f"ratio {s / c:.3f}; systemd ahead in {ahead} of {pairs}")


def budget(tsp_wall: float, n: int, motor: dict[str, tuple[float, float, float]]) -> None:
    """What task-spooler's rate leaves the runner, from the medians (seconds per round):
    on two CPUs a job may cost the host at most 2 / rate CPU seconds; the runner's one
    thread must also run it, and wait for a CPU, within 1 / rate (docs/performance.md,
    "The budget at task-spooler's rate"). `motor`: {peer: (host busy, runner's CPU, runner's
    wait)}."""
    host_ms, thread_ms = 2 * tsp_wall / n * 1e3, tsp_wall / n * 1e3
    print(f"# budget at task-spooler's {n / tsp_wall:.1f} jobs/s: {host_ms:.2f} ms of host CPU"
          f" per job on two CPUs, {thread_ms:.2f} ms of the runner's thread")
    for peer, (busy, runner, wait) in motor.items():
        others, own, waits = (busy - runner) / n * 1e3, runner / n * 1e3, wait / n * 1e3
        print(f"# {peer:<11} others (the client, keeperd, the jobs) {others:.2f} ms/job leave "
              f"the runner {host_ms - others:.2f}; it ran {own:.2f} and waited {waits:.2f} for a CPU")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--systemd-namespace", action="store_true")
    ap.add_argument("--cli", action="store_true",
                    help="also submit through the CLI: a process per job, and one `submit --from`")
    ap.add_argument("--spawners", default="", help="e.g. keeperd,forkserver (MOTOR_SPAWNER)")
    ap.add_argument("--poll-status", action="store_true",
                    help="also peer=motor-poll: the end waited for with GET /v1/status every 2 ms")
    ap.add_argument("--backend-pairs", type=int, default=0, metavar="N",
                    help="N pairs: systemd (in a namespace) against cgroup, fresh runners")
    args = ap.parse_args()
    fs_note()
    if args.backend_pairs:
        backend_pairs(args.backend_pairs, args.n)
        return
    base = {"motor": "api", "motor-client": "api-client", "motor-batch": "batch"}
    if args.poll_status:
        base["motor-poll"] = "api-poll"
    if args.cli:
        base.update({"motor-cli-each": "cli-each", "motor-cli-from": "cli-from"})
    spawners = [s for s in args.spawners.split(",") if s] or [None]
    # peer name -> (mode, spawner); without --spawners the names stay as they were
    modes = {(f"{peer}-{sp}" if sp else peer): (mode, sp)
             for sp in spawners for peer, mode in base.items()}
    walls: dict[str, list[float]] = {peer: [] for peer in modes} | {"bare-xargs": [], "tsp": []}
    submits: dict[str, list[float]] = {peer: [] for peer in modes}
    busy: dict[str, list[float]] = {peer: [] for peer in walls}  # host CPU s per round
    runner: dict[str, list[float]] = {peer: [] for peer in modes}  # the runner's own
    waited: dict[str, list[float]] = {peer: [] for peer in modes}  # ... waits for a CPU
    for _ in range(args.rounds):
        for peer, (mode, sp) in modes.items():
            own: dict[str, float] = {}
            wall, sub, cpu = motor_round(args.n, args.isolation, args.systemd_namespace,
                                         mode=mode, spawner=sp, own=own)
            mine = "".join(f"{name}{'' if name.endswith('_wait') else '_cpu'}_per_job_ms="
                           f"{s / args.n * 1e3:.2f} " for name, s in own.items())
            emit(peer, wall, args.n, f"submit_s={sub:.6f} submit_jobs_per_s={args.n / sub:.1f} "
                                     f"host_cpu_per_job_ms={cpu / args.n * 1e3:.2f} {mine}"
                                     f"isolation={args.isolation} "
                                     f"load1={os.getloadavg()[0]:.2f}")
            walls[peer].append(wall)
            submits[peer].append(sub)
            busy[peer].append(cpu)
            if "runner" in own:
                runner[peer].append(own["runner"])
                waited[peer].append(own["runner_wait"])
        if not args.no_peers:
            for peer in ("bare-xargs", "tsp"):
                got = peer_round(peer, args.n)
                if got is not None:
                    walls[peer].append(got[0])
                    busy[peer].append(got[1])
    print("# medians (host CPU: every process's, per job, over the burst)")
    med = {p: statistics.median(v) for p, v in walls.items() if v}
    for peer, m in med.items():
        print(f"# {peer:<11} {m:8.4f} s  {args.n / m:8.1f} jobs/s  host CPU "
              f"{statistics.median(busy[peer]) / args.n * 1e3:5.2f} ms/job"
              + (f"  runner's own {statistics.median(runner[peer]) / args.n * 1e3:5.2f} ms/job"
                 if runner.get(peer) else ""))
    for name in (n for n in modes if n in med):
        for peer in ("bare-xargs", "tsp"):
            if peer in med:
                print(f"# {name}/{peer} jobs/s ratio: {med[peer] / med[name]:.3f}")
    if "tsp" in med:
        budget(med["tsp"], args.n, {peer: (statistics.median(busy[peer]), statistics.median(
            runner[peer]), statistics.median(waited[peer])) for peer in modes if runner[peer]})
    sub = {p: statistics.median(v) for p, v in submits.items() if v}
    for peer, m in sub.items():
        print(f"# {peer:<14} submit {m:8.4f} s  {args.n / m:8.1f} jobs/s accepted")
    if "motor-batch" in sub:
        print(f"# submit rate, one batch / one request per job: {sub['motor'] / sub['motor-batch']:.2f}x")
    if "motor-cli-from" in sub:
        print(f"# submit rate, one `submit --from` / a `motor submit` per job: "
              f"{sub['motor-cli-each'] / sub['motor-cli-from']:.2f}x")


if __name__ == "__main__":
    main()
