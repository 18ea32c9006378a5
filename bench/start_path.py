"""Where one job's start goes: submit -> spawn request -> job running -> terminal event.

    python bench/start_path.py [--rounds 5] [--samples 22] [--gap 0.3] [--isolation affinity]
                               [--command 'date +%s.%N'] [--bare] [--baseline-root DIR]

Each round runs an embedded runner (`motor.open_runner`, `max_weight=2`) in a fresh process
and submits `--samples` jobs one at a time on an idle runner (`--gap` seconds apart; the
first two are warm-up), each `sh -c 'date +%s.%N >&2'` (or `--command`, whose output holds
its timestamp: `--command 'date +%s.%N'` is the job of bench/latency.py and of the peers'
`latency.sh`). Per job it takes, from the moment just before the submit:

- `start_to_spawn` (ms): until the job actor asks the keeper side for the spawn
  (`Keepers.spawn` called): the runner's own start path (dispatcher, disk check, job
  directory, isolation groups, spec.json);
- `spawn_to_keeperd` (ms): from that call until keeperd reads the request (the time in
  keeperd's answer, `"at"`: docs/keeper.md, "Timings in the answers");
- `keeperd_to_job` (ms): from keeperd's read until the job's own timestamp: keeperd's claim,
  spec and spawn, and the job's exec, the part a bare fork+exec also pays;
- `start_latency_embedded` (ms): until the job's own timestamp (`date`), as bench/latency.py
  measures it, without the HTTP layer;
- `run_wall_embedded` (ms): until the terminal event arrives.

`--bare` runs the peers' `latency.sh bare` after each round (as many samples, the same gap;
peer=bare), so `keeperd_to_job` of `--command 'date +%s.%N'` stands beside a bare fork+exec
of the same `date` from the same minutes.

More samples than bench/latency.py, and no client processes: on a shared host the spread
of single wall figures is large, so `--baseline-root DIR` (the motor package found in DIR,
e.g. `git archive REV | tar -x -C DIR`) runs interleaved rounds as peer=motor-baseline, and
the end shows the medians over every sample of every round. Every line carries load1=.
"""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

from benchlib import ab_parser, field, fs_note, load1, peer_line, run_round
from benchlib import peers as bench_peers

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("start_to_spawn", "spawn_to_keeperd", "keeperd_to_job", "start_latency_embedded",
           "run_wall_embedded")

ROUND = r"""
import json, re, sys, tempfile, time
import trio, motor
from motor.execution import keeperd_client

iso, samples, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
command = json.loads(sys.argv[4]) if len(sys.argv) > 4 else ["sh", "-c", "date +%s.%N >&2"]
spawn_at, read_at = [], []  # time.monotonic(): CLOCK_MONOTONIC, as keeperd's "at"
real_spawn, real_resolve = keeperd_client.KeeperdSpawner.spawn, keeperd_client._Req.resolve

async def spawn(self, job_dir):
    spawn_at.append(time.monotonic())
    return await real_spawn(self, job_dir)

def resolve(self, resp=None, exc=None):
    if self.op == "spawn" and resp is not None and "at" in resp:
        read_at.append(resp["at"][0])
    return real_resolve(self, resp, exc)

keeperd_client.KeeperdSpawner.spawn = spawn
keeperd_client._Req.resolve = resolve
out = {"start_to_spawn": [], "spawn_to_keeperd": [], "keeperd_to_job": [],
       "start_latency_embedded": [], "run_wall_embedded": []}

async def main():
    with tempfile.TemporaryDirectory() as state:
        config = motor.RunnerConfig(state_dir=state, max_weight=2, isolation=iso,
                                    free_space_floor_bytes=0)
        async with motor.open_runner(config) as runner:
            for i in range(samples):
                await trio.sleep(gap)
                spawn_at.clear()
                read_at.clear()
                t0, w0 = time.monotonic(), time.time()
                job = await runner.submit(motor.JobRequest(
                    command=command, workspace="w", weight_hint=1))
                text = []
                async for ev in runner.events(job.job_id):
                    data = getattr(ev, "data", None)
                    if data:
                        text.append(data if isinstance(data, str) else data.decode())
                t1 = time.monotonic()
                if (await runner.get(job.job_id)).state != "succeeded":
                    raise SystemExit(f"job {job.job_id} did not succeed")
                if i < 2:
                    continue
                m = re.search(r"(\d+\.\d+)", "".join(text))
                ran = t0 + float(m.group(1)) - w0  # the job's timestamp, on this clock
                out["start_to_spawn"].append(1000 * (spawn_at[0] - t0))
                if read_at:  # (a keeperd that sends no "at": those two are missing)
                    out["spawn_to_keeperd"].append(1000 * (read_at[0] - spawn_at[0]))
                    out["keeperd_to_job"].append(1000 * (ran - read_at[0]))
                out["start_latency_embedded"].append(1000 * (ran - t0))
                out["run_wall_embedded"].append(1000 * (t1 - t0))
    print(json.dumps(out))

trio.run(main)
"""


def one_round(root: Path, args) -> dict[str, list[float]]:
    return run_round(ROUND, root, args.isolation, str(args.samples), str(args.gap),
                     json.dumps(shlex.split(args.command)))


def main() -> None:
    ap = ab_parser(__doc__, rounds=5)
    ap.add_argument("--samples", type=int, default=22)
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--command", default="sh -c 'date +%s.%N >&2'",
                    help="the job (its output holds its timestamp; default: %(default)s)")
    ap.add_argument("--bare", action="store_true",
                    help="each round, also the peers' `latency.sh bare` (peer=bare)")
    args = ap.parse_args()
    fs_note()
    peers = bench_peers(ROOT, args.baseline_root)
    every: dict[str, dict[str, list[float]]] = {p: {m: [] for m in METRICS} for p, _ in peers}
    bare: list[float] = []
    print(f"# start_path: rounds={args.rounds} samples={args.samples} gap_s={args.gap} "
          f"isolation={args.isolation} command={json.dumps(shlex.split(args.command))} "
          f"load1={load1()}", flush=True)
    for _ in range(args.rounds):
        for peer, root in peers:
            got = one_round(root, args)
            for m in METRICS:
                if not got.get(m):  # an older keeperd sends no "at"
                    continue
                every[peer][m].extend(got[m])
                print(f"peer={peer} metric={m} value={statistics.median(got[m]):.3f} unit=ms "
                      f"samples={len(got[m])} min={min(got[m]):.3f} max={max(got[m]):.3f} "
                      f"isolation={args.isolation} load1={load1()}", flush=True)
        if args.bare and (line := peer_line("latency.sh", ["bare", str(args.samples - 2)],
                                            {"LAT_GAP": str(args.gap)})):
            bare.append(field(line, "value"))
            print(f"{line} load1={load1()}", flush=True)
    print(f"# medians over every sample of {args.rounds} rounds (ms), load1={load1()}")
    for peer, _ in peers:
        for m in METRICS:
            if not (v := every[peer][m]):
                continue
            print(f"# {peer:15s} {m:24s} {statistics.median(v):8.3f}  ({len(v)} samples)")
    if bare:
        print(f"# {'bare':15s} {'start_latency':24s} {statistics.median(bare):8.3f}  (median of "
              f"{len(bare)} rounds' medians: the keeper side of a start, `keeperd_to_job`, against "
              "a bare fork+exec of `date`)")


if __name__ == "__main__":
    main()
