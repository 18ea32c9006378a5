"""What hypercorn's layers cost motor's start latency: `motor serve` as it is, beside the same
runner and app with each connection served by h11 alone, in the peers' line format.

    python bench/http_layer.py [--rounds 3] [--samples 20] [--gap 0.3] [--isolation affinity]
                               [--no-peers] [--burst N]

Each round starts two runners on fresh state dirs, in a random order: `motor serve` as
shipped (peer=motor-hypercorn), and `motor serve` with hypercorn's per-connection handler
(motor/api/server.py `_TCPServer`) replaced, in that process only, by a plain trio loop
around an `h11.Connection` that calls the same ASGI app (peer=motor-h11). The listeners,
the connection cap, the app and everything behind it are the same. Against each it takes
bench/latency.py's samples: `start_latency` (submit -> the job's own `date +%s.%N`) and
`api_run_wall` (until the terminal event), motor's own client, one kept connection.
`latency.sh bare` runs in the same round (peer=bare).

`--burst N` measures throughput instead: in each round, against each runner, N jobs of
`true` over 4 workspaces, one request each from motor's own client on one kept connection,
each answered before the next, until none is queued or running (`GET /v1/status` every
2 ms once all are in; every job must have succeeded): `jobs_per_s`, and
`runner_cpu_per_job_ms`, the runner process's own CPU over the burst (/proc/PID/stat).
Each round also runs the peers' `throughput.sh tsp N` (peer=tsp; not with `--no-peers`),
and the medians give each server's rate against task-spooler's.

The h11 loop here is a measuring probe, not a server motor ships: it serves the Unix
socket's requests as the latency samples make them (a JSON body, an NDJSON stream, keep-
alive) and nothing of what motor/api/server.py gets from hypercorn (the head timeout,
graceful shutdown, protocol errors answered 400, `Expect: 100-continue`, TCP). It tells
how much of the start latency is hypercorn's, and so what keeping hypercorn costs
(docs/performance-history.md, "Stop 40").
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ended_jobs, field, fs_note, load1, peer_line, process_cpu_s
from latency import Client, api_samples, emit, peer_latency, samples_parser, start_runner

#: `python -c` program: run `motor ARGV...`, with h11 serving each connection when the first
#: argument is "h11"
SERVE = r"""
import runpy, sys
variant, argv = sys.argv[1], sys.argv[2:]
if variant == "h11":
    from urllib.parse import unquote
    import h11
    import motor.api.server as server

    class H11Connection:
        # hypercorn's `_TCPServer(app, config, context, state, stream)`, awaited once
        def __init__(self, app, config, context, state, stream):
            self.app, self.stream = app, stream
            self.conn = h11.Connection(h11.SERVER)

        def __await__(self):
            return self.serve().__await__()

        async def next_event(self):
            while (event := self.conn.next_event()) is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
            return event

        async def serve(self):
            while isinstance(request := await self.next_event(), h11.Request):
                if not await self.exchange(request):
                    return
                self.conn.start_next_cycle()

        async def exchange(self, request):
            conn, stream = self.conn, self.stream
            path, _, query = request.target.partition(b"?")
            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                     "http_version": request.http_version.decode(),
                     "method": request.method.decode(), "scheme": "http",
                     "path": unquote(path.decode("ascii")), "raw_path": path,
                     "query_string": query, "root_path": "", "headers": list(request.headers),
                     "client": None, "server": None, "extensions": {}}
            state = {"body_done": False, "gone": False, "ended": False, "head": None}

            async def receive():
                if not state["body_done"]:
                    event = await self.next_event()
                    if isinstance(event, h11.Data):
                        return {"type": "http.request", "body": bytes(event.data),
                                "more_body": True}
                    state["body_done"] = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                while not state["gone"]:  # after the body: wait for the client to leave
                    data = await stream.receive_some(65536)
                    state["gone"] = not data
                    conn.receive_data(data)  # (a next request: parsed in its turn)
                return {"type": "http.disconnect"}

            async def send(message):
                if message["type"] == "http.response.start":
                    state["head"] = (message["status"], list(message.get("headers", [])))
                    return
                body, more = message.get("body", b""), message.get("more_body", False)
                out = b""
                if state["head"] is not None:
                    status, headers = state["head"]
                    state["head"] = None
                    if not more and not any(k.lower() == b"content-length" for k, _ in headers):
                        headers.append((b"content-length", b"%d" % len(body)))
                    out += conn.send(h11.Response(status_code=status, headers=headers))
                if body:
                    out += conn.send(h11.Data(data=body))
                if not more:
                    out += conn.send(h11.EndOfMessage())
                    state["ended"] = True
                if out:
                    await stream.send_all(out)

            await self.app(scope, receive, send, None, None)
            while not state["body_done"] and not isinstance(await self.next_event(),
                                                          h11.EndOfMessage):
                pass
            return state["ended"] and not state["gone"] and conn.our_state is h11.DONE

    if not hasattr(server, "_TCPServer"):  # else the probe would replace nothing, silently
        raise SystemExit("motor/api/server.py has no _TCPServer for the h11 probe to replace")
    server._TCPServer = H11Connection
sys.argv = ["motor", *argv]
runpy.run_module("motor", run_name="__main__", alter_sys=True)
"""

VARIANTS = ("hypercorn", "h11")


def burst(proc, sock: Path, n: int) -> tuple[float, float]:
    """(jobs/s, the runner's own CPU ms per job) for N `true` jobs, one request each."""
    with Client(sock, timeout=60) as client:
        client.health()
        cpu0, t0 = process_cpu_s(proc.pid), time.perf_counter()
        for i in range(n):
            client.submit({"command": ["true"], "weight_hint": 1, "workspace": f"ws{i % 4}"},
                          raw=True)
        while (status := client.call("GET", "/v1/status"))["running"] or status["queued"]:
            time.sleep(0.002)
        rate, cpu = n / (time.perf_counter() - t0), (process_cpu_s(proc.pid) - cpu0) / n * 1e3
        if (ok := sum(j.state == "succeeded" for j in ended_jobs(sock))) != n:
            raise SystemExit(f"only {ok} of the {n} jobs succeeded")
        return rate, cpu


def bursts(args) -> None:
    """`--burst N`: each round, each server, one burst; then the medians."""
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    tsp: list[float] = []
    for _ in range(args.rounds):
        for variant in random.sample(VARIANTS, len(VARIANTS)):
            with tempfile.TemporaryDirectory(prefix="motor-http-") as tmp:
                proc, sock = start_runner(Path(tmp), args.isolation,
                                          (sys.executable, "-c", SERVE, variant),
                                          "--max-queue-depth", str(args.burst + 10))
                try:
                    rate, cpu = burst(proc, sock, args.burst)
                finally:
                    proc.terminate()
                    proc.wait(30)
            got[variant].append((rate, cpu))
            print(f"peer=motor-{variant} metric=jobs_per_s value={rate:.1f} n={args.burst} "
                  f"slots=2 runner_cpu_per_job_ms={cpu:.2f} isolation={args.isolation} "
                  f"server={variant} load1={load1()}", flush=True)
        if not args.no_peers and (line := peer_line("throughput.sh", ["tsp", str(args.burst)])):
            tsp.append(field(line, "jobs_per_s"))
            print(f"{line} load1={load1()}", flush=True)
    print(f"# medians over {args.rounds} rounds, load1={load1()}")
    for variant, values in got.items():
        rate = statistics.median(r for r, _ in values)
        print(f"# motor-{variant:10s} {rate:8.1f} jobs/s  "
              f"runner CPU {statistics.median(c for _, c in values):5.2f} ms/job"
              + (f"  {rate / statistics.median(tsp):.3f}x task-spooler" if tsp else ""))
    if tsp:
        print(f"# tsp              {statistics.median(tsp):8.1f} jobs/s")


def main() -> None:
    ap = samples_parser(__doc__, samples=20)
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="instead: N jobs of `true`, one request each (jobs/s, runner CPU)")
    args = ap.parse_args()
    fs_note()
    if args.burst:
        return bursts(args)
    print(f"# http_layer: rounds={args.rounds} samples={args.samples} gap_s={args.gap} "
          f"isolation={args.isolation} load1={load1()}", flush=True)
    medians: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for variant in random.sample(VARIANTS, len(VARIANTS)):
            with tempfile.TemporaryDirectory(prefix="motor-http-") as tmp:
                proc, sock = start_runner(Path(tmp), args.isolation,
                                          (sys.executable, "-c", SERVE, variant))
                try:
                    lat, walls = api_samples(sock, args.samples, args.gap)
                finally:
                    proc.terminate()
                    proc.wait(30)
            extra = f"isolation={args.isolation} server={variant}"
            for metric, values in (("start_latency", lat), ("api_run_wall", walls)):
                medians.setdefault(f"motor-{variant} {metric}", []).append(
                    emit(f"motor-{variant}", metric, values, extra=extra))
        if not args.no_peers:
            value = peer_latency("bare", args.samples, args.gap)
            if value is not None:
                medians.setdefault("bare start_latency", []).append(value)
    print(f"# medians over {args.rounds} rounds (ms), load1={load1()}")
    for key, values in medians.items():
        print(f"# {key:32s} {statistics.median(values):8.3f}")
    bare = medians.get("bare start_latency")
    for variant in VARIANTS:
        if bare and (lat := medians.get(f"motor-{variant} start_latency")):
            print(f"# motor-{variant} start_latency / fork+exec (bare): "
                  f"{statistics.median(lat) / statistics.median(bare):.2f}x")


if __name__ == "__main__":
    main()
