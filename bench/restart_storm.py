"""Restart storm with a history check: kill -9 a real `motor serve` K times under load.

    python bench/restart_storm.py [--jobs 60] [--kills 10] [--seed 1] [--isolation affinity]
                                  [--max-gap 1.5] [--fault POINT=kill:P] [--keep]
                                  [--spawner keeperd|forkserver]

Not a test (not in CI): it prints figures and the violations it found, and exits 1 if any.

A runner on a temporary state dir (its own `--cgroup-parent` under cgroup isolation, so
no other runner's or test's cleanup of the shared `motor-jobs` parent can kill its jobs;
`--max-weight` = its allowed CPUs, claims of 1 or 2, so
the seed never allows two running jobs to share a CPU: overlap is allowed only once every
allowed CPU is claimed, which `max_weight <= allowed` rules out). A submitter thread posts
`--jobs` jobs with small random gaps, retrying while the runner is down. Each job is a
shell that appends to a ledger file, with O_APPEND single-line writes:

    start <MOTOR_JOB_ID> <pid> <ns> <MOTOR_CPUS> <Cpus_allowed_list>
    end   <MOTOR_JOB_ID> <pid> <ns>

(jobs learn their id from `$MOTOR_JOB_ID`), sleeps 0.05-1.2 s, and exits. Meanwhile the
runner is killed with SIGKILL `--kills` times at random moments (0.1 s to `--max-gap` after
it came up) and started again at once. At the end, once nothing is queued or running, it
checks:

- every accepted id (and every id the runner knows, including one accepted just before a
  kill whose reply never arrived) has exactly one terminal event, its record is terminal,
  and its event seqs are strictly increasing;
- no id appears twice as `start` in the ledger (it ran twice: the double-spawn window), and
  a succeeded job has both lines;
- each job's pinned CPUs (`Cpus_allowed_list`, under an isolation that pins) equal its
  recorded `MOTOR_CPUS`, with min(claim, allowed) CPUs;
- every job succeeds (each is a `sleep` that exits 0) and writes both lines;
- no two jobs whose ledger intervals overlap share a CPU, and the claims of overlapping
  jobs never exceed max_weight.

`--fault POINT=kill:P` (repeatable) also lets the runner SIGKILL itself with probability P
each time it passes a named fault point (motor/faults.py), e.g. `setup.spawned=kill:0.3`
right after the forkserver reported a keeper (before keeper.json may exist): the
double-spawn window. A runner that died that way is restarted like the others.

Figures: jobs, acknowledged and unacknowledged accepts, kills, restarts, terminal states,
violations by kind, wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
#: MOTOR_SPAWNER for the runner (--spawner); None: the runner's default
SPAWNER: str | None = None
TERMINAL = {"succeeded", "failed", "cancelled", "timed_out", "lost", "refused_before_start"}

JOB = r'''
ledger=$1; nap=$2
cpus=$(grep Cpus_allowed_list /proc/self/status | cut -f2)
echo "start $MOTOR_JOB_ID $$ $(date +%s%N) ${MOTOR_CPUS:--} $cpus" >> "$ledger"
sleep "$nap"
echo "end $MOTOR_JOB_ID $$ $(date +%s%N)" >> "$ledger"
'''


def parse_cpus(text: str) -> frozenset[int]:
    out: set[int] = set()
    if text in ("", "-"):
        return frozenset()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return frozenset(out)


class Runner:
    """One `motor serve` process at a time on a fixed state dir."""

    def __init__(self, state: Path, args: list[str], faults: str = ""):
        self.state, self.args, self.faults = state, args, faults
        self.log = state.parent / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.up = threading.Event()
        self.starts = 0
        self.fault_kills = 0

    def start(self) -> None:
        seen = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "motor", "serve", "--state-dir", str(self.state), *self.args],
                stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**{k: v for k, v in os.environ.items() if not k.startswith("MOTOR_")},
                     **({"MOTOR_FAULTS": self.faults} if self.faults else {}),
                     **({"MOTOR_SPAWNER": SPAWNER} if SPAWNER else {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() == -signal.SIGKILL and self.faults:
                self.fault_kills += 1  # a fault point hit while it started up: again
                return self.start()
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited {self.proc.returncode}:\n"
                                 f"{self.log.read_bytes()[seen:].decode(errors='replace')}")
            if b"listening on" in self.log.read_bytes()[seen:]:
                self.starts += 1
                self.up.set()
                return
            time.sleep(0.01)
        raise SystemExit("serve did not start")

    def died(self) -> bool:
        """True (once) when the runner ended by itself: a fault point killed it."""
        if self.proc is not None and self.proc.poll() is not None and self.up.is_set():
            self.up.clear()
            self.fault_kills += 1
            return True
        return False

    def kill9(self) -> None:
        self.up.clear()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def client(state: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(state / "motor.sock")),
                        base_url="http://motor", timeout=30)


def submitter(runner: Runner, n: int, rng: random.Random, ledger: Path, accepted: dict,
              errors: list, done: threading.Event) -> None:
    for i in range(n):
        claim = rng.choice((1, 1, 2))
        body = {"command": ["sh", "-c", JOB, "job", str(ledger), f"{rng.uniform(0.05, 1.2):.3f}"],
                "weight_hint": claim, "workspace": f"ws{i % 6}"}
        deadline = time.monotonic() + 120
        while True:
            runner.up.wait(60)
            try:
                with client(runner.state) as c:
                    r = c.post("/v1/jobs", json=body)
                if r.status_code == 202:
                    accepted[r.json()["job_id"]] = claim
                    break
                errors.append(f"submit {i}: {r.status_code} {r.text[:200]}")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    errors.append(f"submit {i}: runner unreachable for 120 s")
                    break
                time.sleep(0.02)  # down (being killed or restarting): try again
        time.sleep(rng.uniform(0, 0.15))
    done.set()


def read_ledger(ledger: Path):
    starts: dict[str, list[tuple]] = collections.defaultdict(list)
    ends: dict[str, list[tuple]] = collections.defaultdict(list)
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        f = line.split()
        if f[0] == "start" and len(f) >= 5:
            starts[f[1]].append((int(f[2]), int(f[3]), parse_cpus(f[4]),
                                 parse_cpus(f[5]) if len(f) > 5 else frozenset()))
        elif f[0] == "end" and len(f) == 4:
            ends[f[1]].append((int(f[2]), int(f[3])))
    return starts, ends


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--isolation", default="affinity")
    ap.add_argument("--max-gap", type=float, default=1.5)
    ap.add_argument("--keep", action="store_true", help="keep the temporary state dir")
    ap.add_argument("--spawner", choices=["keeperd", "forkserver"], default=None,
                    help="MOTOR_SPAWNER for the runner (default: the runner's default)")
    ap.add_argument("--fault", action="append", default=[], metavar="POINT=kill:P",
                    help="also let the runner kill itself at a named point (motor/faults.py), "
                         "e.g. setup.spawned=kill:0.3 aims at the double-spawn window")
    args = ap.parse_args()
    global SPAWNER
    SPAWNER = args.spawner
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="motor-storm-"))
    state, ledger = tmp / "state", tmp / "ledger.txt"
    serve_args = ["--free-space-floor-bytes", "0", "--isolation", args.isolation]
    if args.isolation in ("cgroup", "auto"):  # a private parent: never shares host groups
        serve_args += ["--cgroup-parent", f"motor-storm-{os.getpid()}"]
    # the runner keeps a core back on hosts with >= 4 cores; its health report says which
    probe = Runner(state, serve_args)
    probe.start()
    with client(state) as c:
        cpus = c.get("/v1/health").json()["cpus"]
    probe.stop()
    allowed = sorted(cpus["allowed"])
    max_weight = len(allowed)
    runner = Runner(state, [*serve_args, "--max-weight", str(max_weight),
                            "--max-queue-depth", str(args.jobs + 10)],
                    faults=",".join(args.fault))
    accepted: dict[str, int] = {}
    errors: list[str] = []
    done = threading.Event()
    t0 = time.monotonic()
    runner.start()
    sub = threading.Thread(target=submitter, daemon=True,
                           args=(runner, args.jobs, random.Random(args.seed + 1), ledger,
                                 accepted, errors, done))
    sub.start()
    kills = 0

    def nap(seconds: float) -> None:
        """Sleep, restarting a runner that a fault point killed meanwhile."""
        until = time.monotonic() + seconds
        while True:
            if runner.died():
                runner.start()
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.02))

    try:
        while kills < args.kills:
            nap(rng.uniform(0.1, args.max_gap))
            runner.kill9()
            kills += 1
            runner.start()
        deadline = time.monotonic() + 600
        while sub.is_alive() and time.monotonic() < deadline:
            nap(0.1)
        if sub.is_alive():
            errors.append("the submitter did not finish in 600 s")
        # wait for the end: nothing queued or running
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with client(state) as c:
                    st = c.get("/v1/status").json()
                if not st["queued"] and not st["running"]:
                    break
            except httpx.TransportError:
                pass  # a fault point killed it: nap() restarts it
            nap(0.1)
        else:
            errors.append("jobs still queued or running after 600 s")
        wall = time.monotonic() - t0
        runner.faults = ""  # the checks below read from a runner that stays up
        runner.kill9()
        runner.start()
        with client(state) as c:
            records = {r["job_id"]: r for r in c.get("/v1/jobs", params={"all": 1}).json()}
            streams = {}
            for job_id in sorted(set(records) | set(accepted)):
                r = c.get(f"/v1/jobs/{job_id}/events", params={"from_seq": 0}, timeout=60)
                streams[job_id] = ([json.loads(x) for x in r.text.splitlines() if x.strip()]
                                   if r.status_code == 200 else None)
        return report(args, runner, kills, wall, max_weight, allowed, accepted, records, streams,
                      ledger, errors)
    finally:
        runner.stop()
        from motor.execution.spawner import cancel_keepers_under

        cancel_keepers_under(state)
        for d in Path("/sys/fs/cgroup").glob(f"*/motor-storm-{os.getpid()}"):
            subprocess.run(["rmdir", str(d)], capture_output=True)  # empty by now
        subprocess.run(["rmdir", f"/sys/fs/cgroup/motor-storm-{os.getpid()}"], capture_output=True)
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)])
        else:
            print(f"# kept {tmp}")


def report(args, runner, kills, wall, max_weight, allowed, accepted, records, streams, ledger,
           errors) -> int:
    v: dict[str, list[str]] = collections.defaultdict(list)
    for e in errors:
        v["harness"].append(e)
    starts, ends = read_ledger(ledger)
    ids = set(records) | set(accepted)
    states = collections.Counter()
    for job_id in sorted(ids):
        rec = records.get(job_id)
        if rec is None:
            v["accepted_but_unknown"].append(job_id)
            continue
        states[rec["state"]] += 1
        if rec["state"] not in TERMINAL:
            v["not_terminal"].append(f"{job_id} {rec['state']}")
        events = streams.get(job_id) or []
        terminals = [e for e in events if e.get("event") == "terminal"]
        if len(terminals) != 1:
            v["terminal_count"].append(f"{job_id}: {len(terminals)} terminal events")
        seqs = [e["seq"] for e in events]
        if seqs != sorted(set(seqs)):
            v["seq_order"].append(f"{job_id}: {seqs}")
        if sum(1 for e in events if e.get("event") == "started") > 1:
            v["started_twice"].append(job_id)
        if len(starts.get(job_id, ())) > 1:
            pids = [s[0] for s in starts[job_id]]
            v["ran_twice"].append(f"{job_id}: pids {pids}")
        if rec["state"] != "succeeded":  # every job is `sleep` and exit 0: anything else is a loss
            v["not_succeeded"].append(f"{job_id}: {rec['state']} {rec.get('reason')}: "
                                      f"{(rec.get('detail') or '')[:160]}")
        if rec["state"] == "succeeded" and not (starts.get(job_id) and ends.get(job_id)):
            v["succeeded_without_ledger"].append(job_id)
        claim = rec.get("claim") or accepted.get(job_id) or 1
        for pid, ns, recorded, pinned in starts.get(job_id, ()):
            if len(recorded) != min(claim, len(allowed)):
                v["cpu_count"].append(f"{job_id}: claim {claim}, cpus {sorted(recorded)}")
            if args.isolation != "none" and pinned != recorded:
                v["pinning"].append(f"{job_id}: recorded {sorted(recorded)}, pinned {sorted(pinned)}")
    for job_id in set(starts) - ids:
        v["ran_but_unknown"].append(job_id)
    # concurrency: intervals from each run's own start and end lines
    # a run without an end line (killed, lost) ends, at the latest, when its record ended
    runs = []
    for job_id, ss in starts.items():
        ee = {pid: ns for pid, ns in ends.get(job_id, ())}
        rec = records.get(job_id) or {}
        claim = rec.get("claim") or accepted.get(job_id) or 1
        ended = rec.get("ended_at_ms")
        for pid, ns, recorded, pinned in ss:
            if pid not in ee:
                v["no_end_line"].append(f"{job_id}: pid {pid}, record {rec.get('state')} "
                                        f"{rec.get('reason')}: {(rec.get('detail') or '')[:120]}")
            runs.append((ns, ee.get(pid, ended * 1_000_000 if ended else 2**63), job_id, claim,
                         pinned or recorded))
    runs.sort()
    for i, (a0, a1, aid, aclaim, acpus) in enumerate(runs):
        for b0, b1, bid, bclaim, bcpus in runs[i + 1:]:
            if b0 >= a1:
                break
            if acpus & bcpus:
                v["cpu_overlap"].append(f"{aid} and {bid} share cpus {sorted(acpus & bcpus)}")
    events_ = sorted([(s, 1, c) for s, e, _, c, _ in runs] + [(e, 0, c) for s, e, _, c, _ in runs])
    load = peak = 0
    for _, kind, c in events_:  # ends before starts at the same instant
        load += c if kind else -c
        peak = max(peak, load)
    if peak > max_weight:
        v["over_max_weight"].append(f"peak concurrent claims {peak} > max_weight {max_weight}")

    unacked = len(set(records) - set(accepted))
    print(f"restart storm: jobs={args.jobs} accepted_acknowledged={len(accepted)} "
          f"accepted_unacknowledged={unacked} kills={kills} fault_kills={runner.fault_kills} "
          f"faults={','.join(args.fault) or '-'} starts={runner.starts} "
          f"isolation={args.isolation} spawner={SPAWNER or 'default'} "
          f"max_weight={max_weight} allowed_cpus={allowed} "
          f"seed={args.seed}")
    print(f"terminal states: {dict(sorted(states.items()))}")
    print(f"ledger: runs={len(runs)} ids_started={len(starts)} peak_concurrent_claims={peak}")
    total = sum(len(x) for x in v.values())
    kinds = ("ran_twice", "terminal_count", "not_terminal", "started_twice", "seq_order",
             "cpu_overlap", "over_max_weight", "cpu_count", "pinning", "accepted_but_unknown",
             "ran_but_unknown", "succeeded_without_ledger", "not_succeeded", "no_end_line",
             "harness")
    print("violations: " + " ".join(f"{k}={len(v.get(k, ()))}" for k in kinds) + f" total={total}")
    for k in kinds:
        for line in v.get(k, ())[:10]:
            print(f"  {k}: {line}")
    print(f"wall_s={wall:.2f}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
