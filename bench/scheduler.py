"""The pure scheduler at scale: the reference core (before) against the incremental core (after).

Run: python bench/scheduler.py [--sizes 1000,10000] [--rounds 21] [--only core|reference]
                              [--workspaces 2000] [--max-weight 8] [--plain]

Setup per size N: max_weight 8, N jobs queued over 2,000 workspaces (job i in workspace
i % 2000, claim 2, every tenth a warm_build, every fiftieth with a sibling workspace, half
of them runner-enforced as `motor submit` jobs are), ready 1 ms apart, then decide(): 4 run.
Each round, with the queue kept at N:
  finished()   one running job ends,
  decide()     the decision that starts the next job (after that finished()),
  ready()      a new job joins (accepted just before; accept() is not timed),
  next_wakeup() what the dispatcher asks after every message.
Printed: the median of the rounds, per call.  Then, once per size:
  finished() after the heads pass 60 s  (time jumps 61 s: every head ages on the way),
  finished() + decide(), heads aged  then, each round, one job ends and the next starts
               (median; with few workspaces and --plain the start is in another
               workspace and moves the fence),
  status view  wait_status() + clock_state() of every queued job; for the core also
               wait_statuses() of all of them (what GET /v1/status does now),
  recovery     a fresh core re-admitting N queued jobs (accept(force) + ready(waited, age))
               and adopting the running ones, as the dispatcher does after a restart.
Single-shot rows say "1 run".  Times are wall-clock (time.perf_counter); the machine is
shared, so read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from motor.scheduling import core, reference  # noqa: E402

WORKSPACES = 2000
MAX_WEIGHT = 8
PLAIN = False  # --plain: claim 1, no warm_build or sibling, every budget runner-enforced


def spec(mod, i: int, enforce: bool | None = None):
    ws = f"w{i % WORKSPACES}"
    if PLAIN:
        return core.JobSpec(f"j{i}", ws, claim=1,
                            runner_enforces_budget=True if enforce is None else enforce)
    siblings = (f"w{(i + 7) % WORKSPACES}",) if i % 50 == 0 else ()
    kind = "warm_build" if i % 10 == 0 else "job"
    return core.JobSpec(f"j{i}", ws, siblings=siblings, claim=2, kind=kind,
                        runner_enforces_budget=(i % 2 == 0) if enforce is None else enforce)


def fill(mod, n: int):
    s = mod.Scheduler(max_weight=MAX_WEIGHT, max_queue_depth=10 * n + 100, claim_limit=MAX_WEIGHT)
    now = 0.0
    for i in range(n):
        s.accept(spec(mod, i), now)
        s.ready(f"j{i}", now)
        now += 0.001
    for st in s.decide(now):
        s.setup_done(st.job_id, now)
    return s, now


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:9.1f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:9.2f} ms"
    return f"{seconds:9.2f} s "


def bench(mod, n: int, rounds: int) -> dict[str, float]:
    s, now = fill(mod, n)
    nxt = n
    running = [j for j in (f"j{i}" for i in range(n)) if s.job_state(j) == "running"]
    rows: dict[str, list[float]] = {"finished()": [], "decide() starting a job": [],
                                    "ready()": [], "next_wakeup()": []}
    for _ in range(rounds):
        now += 0.01
        victim = running.pop(0)
        rows["finished()"].append(timed(s.finished, victim, now))
        t0 = time.perf_counter()
        starts = s.decide(now)
        rows["decide() starting a job"].append(time.perf_counter() - t0)
        assert starts, "the bench expects a start after each finish"
        for st in starts:
            s.setup_done(st.job_id, now)
            running.append(st.job_id)
        for _ in starts:
            s.accept(spec(mod, nxt), now)
            rows["ready()"].append(timed(s.ready, f"j{nxt}", now))
            nxt += 1
        rows["next_wakeup()"].append(timed(s.next_wakeup, now))
    out = {name: statistics.median(v) for name, v in rows.items()}
    # every head passes its 60 s aging point before the next event
    now += 61.0
    out["finished() after heads pass 60 s (1 run)"] = timed(s.finished, running.pop(0), now)

    def start(now: float) -> None:
        for st in s.decide(now):
            s.setup_done(st.job_id, now)
            running.append(st.job_id)

    start(now)
    aged = []
    for _ in range(rounds):
        now += 0.01
        t0 = time.perf_counter()
        s.finished(running.pop(0), now)
        start(now)
        aged.append(time.perf_counter() - t0)
    out["finished() + decide(), heads aged"] = statistics.median(aged)
    queued = [j for j in (f"j{i}" for i in range(nxt)) if s.job_state(j) == "queued"]

    def status_view():
        for j in queued:
            s.wait_status(j, now)
            s.clock_state(j, now)

    out[f"status view, {len(queued)} queued (1 run)"] = timed(status_view)
    if hasattr(s, "wait_statuses"):  # the core: the dispatcher's view, one refresh
        out[f"status view by wait_statuses(), {len(queued)} queued (1 run)"] = \
            timed(s.wait_statuses, queued, now)

    def recover():
        r = mod.Scheduler(max_weight=MAX_WEIGHT, max_queue_depth=10 * n + 100,
                          claim_limit=MAX_WEIGHT)
        t = now + 5.0
        for j in running:
            r.adopt_running(s._jobs[j].spec, t)
        for j in queued:
            waited, _, age = s.clock_state(j, now)
            r.accept(s._jobs[j].spec, t, force=True)
            r.ready(j, t, waited_s=waited, ready_age_s=age)
        r.decide(t)

    out[f"recovery, {len(queued)} queued + {len(running)} running (1 run)"] = timed(recover)
    return out


def WORKSPACES_SET(n: int, max_weight: int = MAX_WEIGHT, plain: bool = False) -> None:  # noqa: N802
    global WORKSPACES, MAX_WEIGHT, PLAIN
    WORKSPACES, MAX_WEIGHT, PLAIN = n, max_weight, plain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--only", choices=["core", "reference"])
    ap.add_argument("--workspaces", type=int, default=WORKSPACES,
                    help="spread the jobs over this many workspaces (1: one deep queue)")
    ap.add_argument("--max-weight", type=int, default=MAX_WEIGHT)
    ap.add_argument("--plain", action="store_true",
                    help="every job claim 1, no warm_build or sibling, runner-enforced (as "
                         "bench/scale.py submits them); with --max-weight 2 and a few "
                         "workspaces, each end frees a workspace and the next start takes "
                         "another (rotation): both flip every clock queued there")
    args = ap.parse_args()
    WORKSPACES_SET(args.workspaces, args.max_weight, args.plain)
    load = os.getloadavg()
    print(f"bench/scheduler.py: max_weight {MAX_WEIGHT}, {args.workspaces} workspaces, "
          f"{'plain claim-1 jobs, ' if PLAIN else ''}"
          f"median of {args.rounds} rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    mods = [("reference (before)", reference), ("core (after)", core)]
    if args.only:
        mods = [m for m in mods if m[1].__name__.endswith(args.only)]
    for n in (int(x) for x in args.sizes.split(",")):
        results = {}
        for label, mod in mods:
            results[label] = bench(mod, n, args.rounds)
        print(f"\n{n} queued:")
        names = max((list(r) for r in results.values()), key=len)
        print(f"  {'':56s}" + "".join(f"{label:>22s}" for label, _ in mods))
        for i, name in enumerate(names):
            cells = []
            for label, _ in mods:
                keys = [k for k in results[label] if k.split(",")[0] == name.split(",")[0]]
                cells.append(f"{fmt(results[label][keys[0]]) if keys else '-':>22s}")
            print(f"  {name.split(',')[0] if 'status' in name or 'recovery' in name else name:56s}"
                  + "".join(cells))
        for label, _ in mods:
            extra = [k for k in results[label] if "status" in k or "recovery" in k]
            print(f"  ({label}: " + "; ".join(extra) + ")")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
