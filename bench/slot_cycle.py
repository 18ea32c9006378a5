"""Where a slot's time goes in a burst: keeperd's steps, the runner's, and the waits between.

    python bench/slot_cycle.py [--rounds 3] [--n 400] [--isolation affinity]
                               [--baseline-root DIR]

Each round runs an embedded runner (as bench/job_cost.py: `max_weight=2`, claims of 1, N
`true` jobs over 4 workspaces, all submitted at once) in a fresh process. keeperd's answers
carry when it read a spawn request and sent its answer, and when it saw a job's main
process end and sent that word (`"at"`, CLOCK_MONOTONIC, docs/keeper.md "Timings in the
answers"); the round adds the runner's side: when the job actor sent the spawn request, when
the runner's reader took each answer off the socket, when the job actor began its end
(`_finish`), and when the next start's request went out (it wraps `KeeperdSpawner.spawn`,
the requests' `resolve` and `JobExecution._finish` in its own process to read them: the
runner has no such figures of its own). For every job, in ms, the median
(and mean) over the round's jobs, in the peers' line format:

- `request_wait`: the spawn request sent -> keeperd reads it;
- `keeperd_spawn`: keeperd's claim, spec, pipes and spawn, until its answer is sent;
- `answer_wait`: the answer sent -> the runner's reader takes it (the runner's loop busy
  with other work meanwhile);
- `job_and_exit`: the answer sent -> keeperd sees the job's main process end (the job's
  own run, and keeperd's loop);
- `keeperd_exit`: keeperd's end of the job (left-overs, output drained, the cgroup facts,
  status.json) until it says so;
- `exit_wait`: that word sent -> the runner's reader takes it;
- `actor_wake`: the reader has it -> the job actor begins the job's end (`_finish`);
- `end_to_next_start`: `_finish` begins -> the next start's spawn request is sent (the
  terminal record, the dispatcher's decision, the next job's actor and its set-up, and
  whatever else the loop ran between);
- `slot_idle`: keeperd sees a job's end -> keeperd reads the next spawn request after it
  (in a burst, the start that takes the freed CPU, unless the other slot's next start was
  still on its way): how long the freed CPU runs no job of the runner;
- and `runner_busy` (the runner's CPU over the wall, per cent) and `jobs_per_s`.

The waits are where the runner's single event loop is the queue: with both slots' work on
one loop, a word from keeperd waits while the loop runs the other job's steps. What one
change does to them shows whether it shortens the slot's cycle or only moves the wait.
`--baseline-root DIR` measures the motor package in DIR the same way, interleaved
(peer=motor-baseline); DIR's keeperd must send `"at"` too, else its keeperd figures are
missing. Every line carries load1=; the end prints the medians over rounds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchlib import BURST, ab_parser, fs_note, load1, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent

STEPS = ("request_wait", "keeperd_spawn", "answer_wait", "job_and_exit", "keeperd_exit",
         "exit_wait", "actor_wake", "end_to_next_start", "slot_idle")

ROUND = BURST + r"""
import bisect, collections, json, os, resource, statistics, sys, time
import trio
from motor.execution import actor as job_actor, keeperd_client

iso, n = sys.argv[1], int(sys.argv[2])
on = False
sent, answered, done, finish = {}, {}, {}, {}  # by job dir: times (and keeperd's "at")

real_spawn, real_resolve = keeperd_client.KeeperdSpawner.spawn, keeperd_client._Req.resolve
real_finish = job_actor.JobExecution._finish

async def spawn(self, job_dir):
    if on:
        sent[os.path.abspath(os.fspath(job_dir))] = time.monotonic()
    return await real_spawn(self, job_dir)

def resolve(self, resp=None, exc=None):
    if on and resp is not None and "at" in resp:
        (answered if self.op == "spawn" else done)[self.job_dir] = (time.monotonic(), resp["at"])
    return real_resolve(self, resp, exc)

async def _finish(self, *args, **kwargs):
    if on:
        finish[str(self.dir)] = time.monotonic()
    return await real_finish(self, *args, **kwargs)

keeperd_client.KeeperdSpawner.spawn = spawn
keeperd_client._Req.resolve = resolve
job_actor.JobExecution._finish = _finish

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

async def main():
    global on
    async with warm_runner(iso, n + 10) as runner:
        on = True
        c0, t0 = cpu(), time.monotonic()
        await burst(runner, n)
        c1, t1 = cpu(), time.monotonic()
        on = False
    steps = collections.defaultdict(list)
    starts = sorted(sent.values())
    reads = sorted(at[0] for _, at in answered.values())
    for d, t_sent in sent.items():
        if d not in answered or d not in done or d not in finish:
            continue
        (t_ans, (k_read, k_ans)), (t_done, (k_exit, k_said)) = answered[d], done[d]
        steps["request_wait"].append(k_read - t_sent)
        steps["keeperd_spawn"].append(k_ans - k_read)
        steps["answer_wait"].append(t_ans - k_ans)
        steps["job_and_exit"].append(k_exit - k_ans)
        steps["keeperd_exit"].append(k_said - k_exit)
        steps["exit_wait"].append(t_done - k_said)
        steps["actor_wake"].append(finish[d] - t_done)
        i = bisect.bisect_left(starts, finish[d])
        if i < len(starts):
            steps["end_to_next_start"].append(starts[i] - finish[d])
        j = bisect.bisect_left(reads, k_exit)
        if j < len(reads):
            steps["slot_idle"].append(reads[j] - k_exit)
    out = {k: [1000 * statistics.median(v), 1000 * statistics.mean(v), len(v)]
           for k, v in steps.items() if v}
    print(json.dumps({"steps": out, "cpu_s": c1 - c0, "wall_s": t1 - t0}))

trio.run(main)
"""


def main() -> None:
    ap = ab_parser(__doc__, rounds=3)
    ap.add_argument("--n", type=int, default=400)
    args = ap.parse_args()
    fs_note()
    peers = bench_peers(ROOT, args.baseline_root)
    medians: dict[str, dict[str, list[float]]] = {p: {} for p, _ in peers}
    print(f"# slot_cycle: rounds={args.rounds} n={args.n} isolation={args.isolation} "
          f"load1={load1()}", flush=True)
    for _ in range(args.rounds):
        for peer, root in peers:
            got = run_round(ROUND, root, args.isolation, str(args.n))
            tail = f"n={args.n} slots=2 isolation={args.isolation} load1={load1()}"
            for step in STEPS:
                if step not in got["steps"]:
                    print(f"# {peer}: no {step} figures (its keeperd sends no \"at\"?)")
                    continue
                median, mean, count = got["steps"][step]
                medians[peer].setdefault(step, []).append(median)
                print(f"peer={peer} metric={step} value={median:.3f} unit=ms mean={mean:.3f} "
                      f"jobs={count} {tail}", flush=True)
            busy = 100 * got["cpu_s"] / got["wall_s"]
            rate = args.n / got["wall_s"]
            medians[peer].setdefault("runner_busy", []).append(busy)
            medians[peer].setdefault("jobs_per_s", []).append(rate)
            print(f"peer={peer} metric=runner_busy value={busy:.1f} unit=% {tail}")
            print(f"peer={peer} metric=jobs_per_s value={rate:.1f} unit=jobs/s {tail}", flush=True)
    print(f"# medians over {args.rounds} rounds of each round's median, load1={load1()}")
    for peer, _ in peers:
        for step, values in medians[peer].items():
            print(f"# {peer:15s} {step:18s} {statistics.median(values):8.3f}")


if __name__ == "__main__":
    main()
