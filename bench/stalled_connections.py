"""Runner memory under stalled request bodies: RSS before, during, after close.

    python bench/stalled_connections.py [--connections 300] [--body-bytes 1048576] [--tcp]
                                        [--body-timeout 30]

Starts a real `python -m motor serve` (isolation none, fresh state dir), reads its RSS
(psutil) as the baseline, then opens N connections that each send the head of a
`POST /v1/jobs` declaring `Content-Length: BODY` and all of the body but its last byte, and
then stall. Once every byte is sent and the runner's RSS has settled, it prints the RSS
"during" and the latency of a `GET /v1/health` from another client meanwhile; then it
closes every stalled connection itself and prints the RSS once it has settled again
("after"). With `--wait-deadline` it instead waits for the runner to close them (the
body read deadline) and counts how many it closed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def rss(proc: psutil.Process) -> int:
    return proc.memory_info().rss


def settled_rss(proc: psutil.Process, *, quiet_s: float = 1.5, limit_s: float = 30.0) -> int:
    """RSS once it has moved by less than 1 MiB over `quiet_s` (or after `limit_s`)."""
    deadline = time.monotonic() + limit_s
    last = rss(proc)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = rss(proc)
        if abs(now - last) < MiB:
            return now
        last = now
    return last


def connect(args, sock_path: Path, port: int | None) -> socket.socket:
    if args.tcp:
        s = socket.create_connection(("127.0.0.1", port))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(sock_path))
    return s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--body-bytes", type=int, default=MiB, help="declared Content-Length")
    parser.add_argument("--tcp", action="store_true", help="stall on a --listen TCP port instead")
    parser.add_argument("--body-timeout", type=float, default=None,
                        help="pass --body-timeout to serve (seconds)")
    parser.add_argument("--wait-deadline", action="store_true",
                        help="let the runner's body deadline close the connections")
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="mb-", dir="/tmp"))
    sock_path = state / "motor.sock"
    port = None
    cmd = [sys.executable, "-m", "motor", "serve", "--state-dir", str(state),
           "--free-space-floor-bytes", "0", "--isolation", "none"]
    if args.tcp:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        token = state / "token"
        token.write_text("bench\n")
        cmd += ["--listen", f"127.0.0.1:{port}", "--token-file", str(token)]
    if args.body_timeout is not None:
        cmd += ["--body-timeout", str(args.body_timeout)]
    log = open(state / "serve.log", "wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    stalled: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while b"listening on" not in (state / "serve.log").read_bytes():
            if server.poll() is not None or time.monotonic() > deadline:
                print((state / "serve.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        proc = psutil.Process(server.pid)
        transport = httpx.HTTPTransport(uds=str(sock_path))
        with httpx.Client(transport=transport, base_url="http://motor", timeout=30) as http:
            for _ in range(20):
                http.get("/v1/health").raise_for_status()
            before = settled_rss(proc)

            head = (b"POST /v1/jobs HTTP/1.1\r\nHost: motor\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer bench\r\n"
                    b"Content-Length: %d\r\n\r\n" % args.body_bytes)
            partial = b"x" * (args.body_bytes - 1)
            started = time.monotonic()
            for _ in range(args.connections):
                s = connect(args, sock_path, port)
                s.sendall(head)
                stalled.append(s)
            # Feed the partial bodies round-robin without blocking on any one connection.
            for s in stalled:
                s.setblocking(False)
            offsets = [0] * len(stalled)
            pending = set(range(len(stalled)))
            refused_early = 0
            while pending:
                progressed = False
                for i in list(pending):
                    try:
                        n = stalled[i].send(partial[offsets[i]:offsets[i] + 256 * 1024])
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, ConnectionResetError):
                        pending.discard(i)
                        refused_early += 1
                        continue
                    offsets[i] += n
                    progressed = True
                    if offsets[i] >= len(partial):
                        pending.discard(i)
                if not progressed:
                    time.sleep(0.005)
            sent_s = time.monotonic() - started
            during = settled_rss(proc)
            t0 = time.monotonic()
            http.get("/v1/health").raise_for_status()
            health_ms = (time.monotonic() - t0) * 1000
            closed_by_runner = 0
            if args.wait_deadline:
                for s in stalled:
                    s.setblocking(True)
                    s.settimeout(max(5.0, 3 * (args.body_timeout or 30)))
                    try:
                        while s.recv(65536):
                            pass
                        closed_by_runner += 1
                    except (socket.timeout, ConnectionResetError):
                        pass
            for s in stalled:
                s.close()
            stalled.clear()
            after = settled_rss(proc)
            http.get("/v1/health").raise_for_status()
        print(f"connections: {args.connections} over {'tcp' if args.tcp else 'unix socket'}, "
              f"each {args.body_bytes - 1} of {args.body_bytes} body bytes sent "
              f"(all sent in {sent_s:.1f} s, {refused_early} cut off early)")
        print(f"runner RSS before: {before / MiB:.1f} MiB")
        print(f"runner RSS during: {during / MiB:.1f} MiB "
              f"(GET /v1/health meanwhile: {health_ms:.1f} ms)")
        if args.wait_deadline:
            print(f"closed by the runner's body deadline: {closed_by_runner} of {args.connections}")
        print(f"runner RSS after close: {after / MiB:.1f} MiB "
              f"({(after - before) / MiB:+.1f} MiB vs before)")
        return 0
    finally:
        for s in stalled:
            s.close()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        subprocess.run(["rm", "-rf", str(state)], check=False)


if __name__ == "__main__":
    sys.exit(main())
