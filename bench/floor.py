"""The floor under motor's start latency: what the parts of its start path cost with
nothing of motor in them, beside bare fork+exec, in the peers' line format.

    python bench/floor.py [--rounds 3] [--samples 20] [--gap 0.3]

Each sample starts one `date +%s.%N` on an idle host (`--gap` seconds apart, plus a random
0-0.1 s) and takes the job's own timestamp minus the time read just before the start was
asked for, as bench/latency.py does for motor and ../shared/bench/peers/latency.sh for
the peers. The variants (peer=floor-VARIANT), each a fresh set of processes per round:

- `spawn`: a trio program `posix_spawn`s the job itself (Python's own spawn, no keeper);
- `keeper`: a trio program sends one line over a Unix socket to a second Python process
  (a selectors loop, as keeperd is) that `posix_spawn`s the job and answers: the hop
  that lets jobs outlive the runner;
- `socket-keeper`: a client process sends the line (one kept Unix socket connection) to a
  trio server that passes it to that keeper process and answers `ok`: the hop from a
  client process into the runner's, without HTTP;
- `http-keeper`: a client process sends `POST` (raw HTTP/1.1, one kept connection) to a
  hypercorn server (trio worker, Unix socket, a bare ASGI app) that sends the line to
  that keeper process and answers 200: the HTTP API on top;
- `http-commit-keeper`: the same with one SQLite commit (WAL, synchronous=NORMAL, one
  row of 1 KiB) before the line is sent: persisting the job before its start.

`latency.sh bare` runs in the same round (peer=bare). None of this is motor: it is what
any runner with motor's shape (an HTTP API, a persisted job, a keeper process that is
not the runner) pays on this host before its own work. Every line carries load1=.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import load1

HERE = Path(__file__).resolve().parent
PEERS = HERE.parent.parent / "shared" / "bench" / "peers"
VARIANTS = ("spawn", "keeper", "socket-keeper", "http-keeper", "http-commit-keeper")
DATE = "/bin/date"

KEEPER = r"""
import os, selectors, socket, sys
path = sys.argv[1]
ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); ls.bind(path); ls.listen(8)
print("ready", flush=True)
conn, _ = ls.accept()
buf = b""
while True:
    data = conn.recv(65536)
    if not data:
        break
    buf += data
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        out = line.decode()
        pid = os.posix_spawn(sys.argv[2], [sys.argv[2], "+%s.%N"], os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)])
        conn.sendall(b"%d\n" % pid)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""

SERVER = r"""
import os, socket, sqlite3, sys, uuid
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
variant, sock_path, keeper_path, db_path = sys.argv[1:5]
keeper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); keeper.connect(keeper_path)
keeper.setblocking(False)
db = None
if "commit" in variant:
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL"); db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, rec BLOB)")
ROW = b"x" * 1024

async def drain():
    s = trio.socket.from_stdlib_socket(keeper)
    while await s.recv(65536):
        pass

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body, more = b"", True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    if db is not None:
        db.execute("BEGIN"); db.execute("INSERT INTO jobs VALUES (?, ?)", (uuid.uuid4().hex, ROW))
        db.execute("COMMIT")
    keeper.send(body + b"\n")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

async def raw(stream):
    buf = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            keeper.send(line + b"\n")
            await stream.send_all(b"ok")

async def main():
    if variant == "socket-keeper":
        listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await listener.bind(sock_path); listener.listen(8)
        async with trio.open_nursery() as n:
            n.start_soon(drain)
            await trio.serve_listeners(raw, [trio.SocketListener(listener)])
    config = Config(); config.bind = ["unix:" + sock_path]; config.accesslog = None
    async with trio.open_nursery() as n:
        n.start_soon(drain)
        await serve(app, config)

trio.run(main)
"""

EMBEDDED = r"""
import json, os, random, socket, sys, time
import trio
variant, keeper_path, outdir, samples, gap, date = sys.argv[1:7]
samples, gap = int(samples), float(gap)

async def main():
    keeper = None
    if variant == "keeper":
        keeper = trio.socket.from_stdlib_socket(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        await keeper.connect(keeper_path)
    lats = []
    for i in range(samples):
        await trio.sleep(gap + random.random() * 0.1)
        out = os.path.join(outdir, f"e{i}")
        t0 = time.time()
        if keeper is None:
            pid = os.posix_spawn(date, [date, "+%s.%N"], os.environ, file_actions=[
                (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)])
            await trio.to_thread.run_sync(os.waitpid, pid, 0)
        else:
            await keeper.send(out.encode() + b"\n")
            await keeper.recv(64)
        lats.append(wait_for(out, t0))
    print(json.dumps(lats))

def wait_for(out, t0):
    for _ in range(2000):
        try:
            with open(out) as f:
                text = f.read()
            if text.endswith("\n"):
                return (float(text) - t0) * 1000
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    raise SystemExit(f"no timestamp in {out}")

trio.run(main)
"""

CLIENT = r"""
import json, os, random, socket, sys, time
sock_path, outdir, samples, gap, raw = sys.argv[1:6]
samples, gap, raw = int(samples), float(gap), raw == "raw"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sock_path)
lats = []
for i in range(samples):
    time.sleep(gap + random.random() * 0.1)
    out = os.path.join(outdir, f"h{i}").encode()
    req = (out + b"\n" if raw else
           b"POST /start HTTP/1.1\r\nhost: floor\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
    t0 = time.time()
    s.sendall(req)
    got = b""
    while not got.endswith(b"ok"):
        got += s.recv(65536)
    for _ in range(2000):
        try:
            with open(out) as f:
                text = f.read()
            if text.endswith("\n"):
                break
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    lats.append((float(text) - t0) * 1000)
print(json.dumps(lats))
"""


def wait_ready(proc: subprocess.Popen, path: str) -> None:
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.01)


def one(variant: str, samples: int, gap: float) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        keeper_path = os.path.join(tmp, "keeper.sock")
        procs: list[subprocess.Popen] = []
        try:
            if variant != "spawn":
                procs.append(subprocess.Popen([sys.executable, "-c", KEEPER, keeper_path, DATE],
                                              stdout=subprocess.PIPE))
                procs[-1].stdout.readline()
            if variant in ("spawn", "keeper"):
                r = subprocess.run([sys.executable, "-c", EMBEDDED, variant, keeper_path, tmp,
                                    str(samples), str(gap), DATE],
                                   capture_output=True, text=True, check=True)
                return json.loads(r.stdout)
            sock = os.path.join(tmp, "api.sock")
            procs.append(subprocess.Popen([sys.executable, "-c", SERVER, variant, sock,
                                           keeper_path, os.path.join(tmp, "db.sqlite")],
                                          stderr=subprocess.DEVNULL))
            wait_ready(procs[-1], sock)
            r = subprocess.run([sys.executable, "-c", CLIENT, sock, tmp, str(samples), str(gap),
                                "raw" if variant == "socket-keeper" else "http"],
                               capture_output=True, text=True, check=True)
            return json.loads(r.stdout)
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait()


def bare(samples: int, gap: float) -> float | None:
    r = subprocess.run(["bash", str(PEERS / "latency.sh"), "bare", str(samples)],
                       capture_output=True, text=True, env=dict(os.environ, LAT_GAP=str(gap)))
    for line in r.stdout.splitlines():
        if line.startswith("peer=bare"):
            return float(line.split("value=")[1].split()[0])
    print(f"# bare: {r.stderr.strip()[-300:]}", flush=True)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gap", type=float, default=0.3)
    args = ap.parse_args()
    print(f"# floor: rounds={args.rounds} samples={args.samples} gap_s={args.gap} "
          f"load1={load1()}", flush=True)
    meds: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "bare")}
    for _ in range(args.rounds):
        order = list(VARIANTS)
        random.shuffle(order)
        for variant in order:
            lats = one(variant, args.samples + 2, args.gap)[2:]  # two warm-up starts
            med = statistics.median(lats)
            meds[variant].append(med)
            print(f"peer=floor-{variant} metric=start_latency value={med:.3f} unit=ms "
                  f"samples={len(lats)} min={min(lats):.3f} max={max(lats):.3f} "
                  f"gap_s={args.gap} load1={load1()}", flush=True)
        b = bare(args.samples, args.gap)
        if b is not None:
            meds["bare"].append(b)
            print(f"peer=bare metric=start_latency value={b:.3f} unit=ms gap_s={args.gap} "
                  f"load1={load1()}", flush=True)
    print(f"# medians over {args.rounds} rounds (ms), load1={load1()}")
    base = statistics.median(meds["bare"]) if meds["bare"] else None
    for v, ms in meds.items():
        if ms:
            ratio = f"  {statistics.median(ms) / base:.2f}x bare" if base else ""
            print(f"# {v:20s} {statistics.median(ms):8.3f}{ratio}")


if __name__ == "__main__":
    main()
