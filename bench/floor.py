"""The floor under motor's start latency and throughput: what the parts of its path cost
with nothing of motor in them (the `rules` variants: with motor's rules, none of its
structure), beside bare fork+exec and task-spooler, in the peers' line format.

    python bench/floor.py [--rounds 3] [--samples 20] [--gap 0.3] [--burst N [--calls]]
                          [--only V,V]

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
- `h11-keeper`: the same `POST` read and answered by h11 (the HTTP/1.1 library under
  hypercorn) in a plain trio connection loop, no ASGI server around it: what hypercorn's
  own layers (its protocol and stream objects, a task per request) add to `http-keeper`;
- `http-commit-keeper`: the `http-keeper` request with one SQLite commit (WAL,
  synchronous=NORMAL, one row of 1 KiB) before the line is sent: persisting the job
  before its start;
- `http-rules-keeper`, `h11-rules-keeper`: the `http-commit-keeper` request (served by
  hypercorn, or by h11 alone) with motor's own rules for a job called inline in the
  request, no actor, no task, no hop: the body is a `JobRequest` decoded and validated by
  msgspec, its `JobRecord` built, the pure scheduler core's `accept`, `ready`, `decide` and
  `setup_done`, the CPU placement's `place`, the record committed with its start, the
  disk check's `statvfs`, the workspace and job directories and the keeper's `spec.json`
  (motor's `write_spec`), the record the answer; at a burst job's end the core's
  `finished`, the placement's `release`, the terminal record committed and the next
  start decided (a burst's jobs over 4 workspaces, as bench/throughput.py's);
- `http-rules-keeperd`: `http-rules-keeper` with motor's own keeperd in place of the
  one-line keeper: a `spawn` request with its `watch` (keeperd's protocol, docs/keeper.md)
  for the job directory the rules made, keeperd reading its spec.json, claiming it,
  spawning the job pinned, writing its output.log and status.json, and telling its end;
- `http-rules-end-keeperd`: `http-rules-keeperd` with each job's end read as a runner
  reads it: status.json, output.log turned into output events (motor's `read_output`),
  and the terminal record (motor's `terminal_record`) committed with those events.

- `http-actors-end-keeperd`: `http-rules-end-keeperd`'s rules and reads laid out as
  docs/architecture.md lays out motor: a supervisor per subsystem (store, CPU allocator,
  disk, accounting, dispatcher, execution) with one actor of motor's runtime (`actors/`)
  each, one temporary actor per job under the execution supervisor (its life in `main`:
  the disk's check and the workspace, the job directory and spec.json, keeperd's spawn
  and its answer awaited, `setup_done`, the end's reads, the CPUs released, `finished`,
  the terminal record committed, accounting told), every message through the receiving
  actor's inbox; the HTTP handler asks the dispatcher, which commits each start through
  the store and places its CPUs through the allocator before it starts the job's actor;
- `http-actors-now-end-keeperd`: the same with the store's, the allocator's, the disk's
  and accounting's messages and the dispatcher's `setup_done` `immediate` (answered in
  the sender's task when the actor is idle) and each job's actor started with
  `start_child_soon`, as motor does;
- `h11-actors-now-end-keeperd`: that served by h11 alone;
- `http-actors-now-accept-end-keeperd`, `h11-actors-now-accept-end-keeperd`: those two
  with a job that does not start at once committed before its answer, as motor commits
  every acceptance (a job started at once is committed with its start).

The `rules` variants are what a runner keeping motor's rules, its commit, its HTTP server
and its keeperd costs with none of motor's structure (no actor, no job task, no hop, no
output read back, no accounting): a bound on what a rewrite of the per-job path could
reach, not a runner. The `actors` variants are the same rules in motor's shape, done
leanly: what the shape the user asked for costs, apart from how motor does the rest. Like
the `rules` variants they commit a queued job only when it starts (but `-accept-`) and
keep no accounts beyond a count.

`latency.sh bare` runs in the same round (peer=bare).

`--burst N` measures throughput instead, as bench/throughput.py does for motor: N jobs
of `true`, at most 2 at a time, one `POST` per job from one client, each answered before
the next is sent, until every job has ended (jobs/s). The keeper queues the jobs and
tells the server of each end, which `http-commit-keeper` commits as a second row (a
runner records a job's acceptance and its end); in the `rules` variants the server's
scheduler core queues them (max_weight 2) and its keeper only runs what it is sent. `throughput.sh tsp N` runs in the same
round (peer=tsp; the peers' setup.sh must have run). Each burst line carries
`server_cpu_per_job_ms`: the serving process's own CPU (/proc/PID/stat) from its socket's
appearance until the last job has ended, per job, as bench/throughput.py's
`runner_cpu_per_job_ms` for motor.

The variants without `rules` are not motor: they are what any runner of motor's shape (an
HTTP API, a persisted job, a keeper process that is not the runner) pays on this host
before its own work.
`--burst N --calls` counts instead of timing: each burst variant once, its server under
cProfile from its first request to its end (its start-up not counted), and prints its
Python calls per job (metric=python_calls_per_job, as bench/work_counts.py's for motor).

`--only V,V` runs only the named variants. Every line carries load1=. `FLOOR_DEBUG=1`
shows the servers' stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import field, load1, peer_line, process_cpu_s

HERE = Path(__file__).resolve().parent
KEEPERD = HERE.parent / "motor" / "execution" / "keeperd.py"
DEBUG = bool(os.environ.get("FLOOR_DEBUG"))  # the servers' stderr shown (a variant that fails)
VARIANTS = ("spawn", "keeper", "socket-keeper", "http-keeper", "h11-keeper",
            "http-commit-keeper", "http-rules-keeper", "h11-rules-keeper", "http-rules-keeperd",
            "http-rules-end-keeperd", "http-actors-end-keeperd", "http-actors-now-end-keeperd",
            "h11-actors-now-end-keeperd", "http-actors-now-accept-end-keeperd",
            "h11-actors-now-accept-end-keeperd")
DATE = "/bin/date"
TRUE = "/bin/true"
SLOTS = 2
BURST_VARIANTS = ("http-keeper", "h11-keeper", "http-commit-keeper", "http-rules-keeper",
                  "h11-rules-keeper", "http-rules-keeperd", "http-rules-end-keeperd",
                  "http-actors-end-keeperd", "http-actors-now-end-keeperd",
                  "h11-actors-now-end-keeperd", "http-actors-now-accept-end-keeperd",
                  "h11-actors-now-accept-end-keeperd")

KEEPER = r"""
import os, select, signal, socket, sys
path, exe, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); ls.bind(path); ls.listen(8)
print("ready", flush=True)
conn, _ = ls.accept()
wake_r, wake_w = os.pipe(); os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w); signal.signal(signal.SIGCHLD, lambda *a: None)
buf, queue, running = b"", [], 0

def start(out):
    # slots 0: a start (`date +%s.%N` into `out`), answered with its pid; else a burst
    # job (`true`), at most `slots` at once, each end told as a line
    if slots == 0:
        pid = os.posix_spawn(exe, [exe, "+%s.%N"], os.environ, file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)])
        conn.sendall(b"%d\n" % pid)
    else:
        os.posix_spawn(exe, [exe], os.environ)

while True:
    ready = select.select([conn, wake_r], [], [])[0]
    if wake_r in ready:
        os.read(wake_r, 4096)
    if conn in ready:
        data = conn.recv(65536)
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        queue.extend(line.decode() for line in lines)
    ended = 0
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            ended += 1
    except ChildProcessError:
        pass
    if slots:
        running -= ended
        if ended:
            conn.sendall(b"x\n" * ended)
    while queue and (slots == 0 or running < slots):
        start(queue.pop(0))
        running += 1 if slots else 0
"""

SERVER = r"""
import json, os, socket, sqlite3, sys, uuid
import h11
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
variant, sock_path, keeper_path, db_path, burst = sys.argv[1:6]
burst = int(burst)
# what the variant's name asks for: motor's rules inline; motor's keeperd (its protocol) in
# place of the one-line keeper; each end read as a runner reads it
RULES, TO_KEEPERD, END = "rules" in variant, variant.endswith("keeperd"), "-end-" in variant
# `actors`: the same rules laid out as motor's architecture lays them out, an actor each
ACTORS, NOW, ACCEPT = "actors" in variant, "-now-" in variant, "-accept-" in variant
RULES = RULES or ACTORS
keeper = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); keeper.connect(keeper_path)
if TO_KEEPERD:  # motor's keeperd: its hello line first
    hello = b""
    while not hello.endswith(b"\n"):
        hello += keeper.recv(4096)
keeper.setblocking(False)
db = None
if "commit" in variant or RULES:
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL"); db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, rec BLOB)")
ROW = b"x" * 1024

def commit():
    db.execute("BEGIN"); db.execute("INSERT INTO jobs VALUES (?, ?)", (uuid.uuid4().hex, ROW))
    db.execute("COMMIT")

if RULES:  # motor's own rules for a job, inline (the docstring's list)
    import collections, time
    import msgspec
    from pathlib import Path
    from motor.cpu.core import CpuPlacement
    from motor.cpu.host import read_topology
    from motor.execution import core as exec_core, jobdir, joblog
    from motor.records import JobRecord, JobRequest, validate_request
    from motor.scheduling import core as sched_core
    sched = sched_core.Scheduler(max_weight=2, max_queue_depth=100_000, claim_limit=2)
    placement = CpuPlacement(read_topology(), sorted(os.sched_getaffinity(0)))
    decode_request = msgspec.json.Decoder(JobRequest).decode
    encode = msgspec.json.Encoder().encode
    replace = msgspec.structs.replace
    jobs_dir, ws_root = Path(db_path + ".jobs"), Path(db_path + ".ws")
    jobs_dir.mkdir(); ws_root.mkdir()
    records, running = {}, collections.deque()  # job id -> record; running, in start order
    ids, watches = [0], {}  # keeperd: the last request id; a watch's id -> its job
    job_dirs = {}  # `-end-`: a job's directory, read at its end
    db.execute("CREATE TABLE IF NOT EXISTS events (job_id TEXT, event BLOB)")

    # each piece of the rules once, for the inline server and the actors alike

    def save(rec, events=()):  # one commit: the record, with its output events
        db.execute("BEGIN")
        if events:
            db.executemany("INSERT INTO events VALUES (?, ?)",
                           [(rec.job_id, encode(event)) for event in events])
        db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?)", (rec.job_id, encode(rec)))
        db.execute("COMMIT")

    def accept(body, now, now_ms):  # a request decoded, checked, its record queued: its id
        req = decode_request(body)
        validate_request(req)
        job_id = uuid.uuid4().hex
        records[job_id] = JobRecord(job_id=job_id, state="queued", workspace=req.workspace,
                                    command=list(req.command), claim=1, env=dict(req.env),
                                    accepted_at_ms=now_ms, queued_at_ms=now_ms)
        sched.accept(sched_core.JobSpec(job_id, req.workspace, claim=1), now)
        sched.ready(job_id, now)
        return job_id

    def running_record(job_id, cpus, now_ms):
        records[job_id] = replace(records[job_id], state="running", cpus=cpus,
                                  started_at_ms=now_ms, attempts=1)
        return records[job_id]

    def workspace(name):  # the disk's check, and the workspace
        os.statvfs(ws_root)
        cwd = ws_root / name
        cwd.mkdir(exist_ok=True)
        return cwd

    def set_up(rec, cwd):  # the job directory with its spec.json
        # keeperd's job directory is where the client looks for the job's output
        job_dir = (Path(rec.env["OUT"] + ".d") if "OUT" in rec.env and TO_KEEPERD
                   else jobs_dir / rec.job_id)
        job_dir.mkdir()
        jobdir.write_spec(job_dir, exec_core.job_spec(rec, str(cwd), rec.env, 0o022))
        return job_dir

    def spawn_request(job_dir):  # keeperd's spawn with its watch: (spawn id, watch id, line)
        ids[0] += 2
        return ids[0], ids[0] + 1, (b'{"id": %d, "op": "spawn", "job_dir": "%s", "watch": %d}\n'
                                    % (ids[0], bytes(job_dir), ids[0] + 1))

    def read_end(rec, job_dir, now_ms):  # the end as a runner reads it: (record, events)
        status = joblog.read_status(job_dir)
        events, _ = jobdir.read_output(job_dir, 0, exec_core.READ_BATCH_BYTES,
                                       exec_core.OutputDecoder())
        return exec_core.terminal_record(rec, status, now_ms, {}), events

    def start_decided(now, now_ms):
        for st in sched.decide(now):
            rec = running_record(st.job_id, list(placement.place(st.job_id, st.claim).cpus),
                                 now_ms)
            save(rec)
            job_dir = set_up(rec, workspace(rec.workspace))
            if END:
                job_dirs[st.job_id] = job_dir
            sched.setup_done(st.job_id, now)
            if TO_KEEPERD:  # spawn, and tell its end (motor's protocol)
                _, watch, line = spawn_request(job_dir)
                watches[watch] = st.job_id
                keeper.send(line)
            else:
                running.append(st.job_id)
                keeper.send(rec.env.get("OUT", "-").encode() + b"\n")

    def rules_submit(body):
        now, now_ms = time.monotonic(), time.time_ns() // 1_000_000
        job_id = accept(body, now, now_ms)
        start_decided(now, now_ms)
        return encode(records[job_id])

    def rules_ended(job_id=None):
        job_id = job_id or running.popleft()
        now, now_ms = time.monotonic(), time.time_ns() // 1_000_000
        sched.finished(job_id, now)
        placement.release(job_id)
        rec = records.pop(job_id)
        if END:  # the end read as a runner reads it, saved with its events in one commit
            save(*read_end(rec, job_dirs.pop(job_id), now_ms))
        else:
            save(replace(rec, state="succeeded", exit_code=0, ended_at_ms=now_ms))
        start_decided(now, now_ms)


if ACTORS:  # the rules above, each subsystem's in an actor of motor's runtime (`actors/`)
    import functools
    import actors

    class Save(tuple): pass      # (record, events): the store's one message
    class Place(tuple): pass     # (job_id, claim)
    class Release(tuple): pass   # (job_id,)
    class Admit(tuple): pass     # (workspace,): the disk's check and the workspace
    class Note(tuple): pass      # ("started" | "ended", record): accounting's
    class Submit(tuple): pass    # (body,)
    class Finished(tuple): pass  # (job_id,)
    class SetupDone(tuple): pass  # (job_id,)

    class Store(actors.Actor):  # the sole writer: a record with its events, one commit
        immediate = (Save,) if NOW else ()
        def handle_now(self, msg):
            save(*msg)

    class Cpu(actors.Actor):
        immediate = (Place, Release) if NOW else ()
        def handle_now(self, msg):
            if isinstance(msg, Place):
                return list(placement.place(*msg).cpus)
            placement.release(msg[0])

    class Disk(actors.Actor):
        immediate = (Admit,) if NOW else ()
        def handle_now(self, msg):
            return workspace(msg[0])

    class Accounting(actors.Actor):
        immediate = (Note,) if NOW else ()
        counts = collections.Counter()
        def handle_now(self, msg):
            self.counts[msg[0]] += 1

    done = [0]  # jobs whose end is recorded
    answers = {}  # keeperd: a request's id -> [its Event, its answer]

    async def keeperd_call(line, *ids):
        # send a request; for each id, an Event set (by `drain`) when its answer comes
        waits = [answers.setdefault(i, [trio.Event(), None]) for i in ids]
        keeper.send(line)
        return waits

    class Job(actors.Actor):  # one per job: set-up, spawn, its end (motor's JobExecution)
        def __init__(self, rec):
            super().__init__(name=f"job-{rec.job_id}")
            self.rec = rec
        async def main(self):
            rec, job_id = self.rec, self.rec.job_id
            job_dir = set_up(rec, await disk.call(Admit((rec.workspace,))))
            spawn, watch, line = spawn_request(job_dir)
            spawned, ended = await keeperd_call(line, spawn, watch)
            await spawned[0].wait()
            if b'"error"' in spawned[1]:  # keeperd refused it (FLOOR_DEBUG shows this)
                raise RuntimeError(spawned[1].decode())
            await dispatcher.call(SetupDone((job_id,)))
            await accounting.cast(Note(("started", rec)))
            await ended[0].wait()
            end, events = read_end(rec, job_dir, time.time_ns() // 1_000_000)
            await cpu.call(Release((job_id,)))
            await dispatcher.call(Finished((job_id,)))
            await store.call(Save((end, events)))
            await accounting.cast(Note(("ended", end)))
            done[0] += 1
            if burst and done[0] == burst:  # every job's end recorded
                open(db_path + ".done", "w").close()

    class Dispatcher(actors.Actor):  # the queue: the scheduler core (the seed's state lock)
        immediate = (SetupDone,) if NOW else ()
        def handle_now(self, msg):
            sched.setup_done(msg[0], time.monotonic())
        async def handle(self, msg):
            now, now_ms = time.monotonic(), time.time_ns() // 1_000_000
            if isinstance(msg, SetupDone):
                return self.handle_now(msg)
            if isinstance(msg, Submit):
                job_id = accept(msg[0], now, now_ms)
                await self.start_decided(now, now_ms)
                if ACCEPT and records[job_id].state == "queued":  # not started: recorded
                    await store.call(Save((records[job_id], ())))  # before its answer
                return encode(records[job_id])
            sched.finished(msg[0], now)
            records.pop(msg[0])
            await self.start_decided(now, now_ms)
        async def start_decided(self, now, now_ms):
            for st in sched.decide(now):
                rec = running_record(st.job_id, await cpu.call(Place((st.job_id, st.claim))),
                                     now_ms)
                await store.call(Save((rec, ())))  # recorded before its CPUs are used
                spec = actors.ChildSpec(st.job_id, functools.partial(Job, rec),
                                        restart="temporary")
                if not NOW or execution.start_child_soon(spec) is None:
                    await execution.start_child(spec)

    store, cpu, disk, accounting, dispatcher = (
        actors.ActorRef(name) for name in ("store", "cpu", "disk", "accounting", "dispatcher"))
    execution = actors.Supervisor("execution", intensity=50, period=10)

    def subsystem(ref, cls):  # a supervisor of its own, the actor its only child
        return actors.ChildSpec(ref.name, lambda: actors.Supervisor(
            ref.name, [actors.ChildSpec(ref.name, cls, ref=ref)], intensity=5, period=10))

    TREE = [subsystem(store, Store), subsystem(cpu, Cpu), subsystem(disk, Disk),
            subsystem(accounting, Accounting), actors.ChildSpec("execution", lambda: execution),
            subsystem(dispatcher, Dispatcher)]


def handle(body):
    # the request's answer: the body to the keeper (committed first with `commit`), or
    # motor's rules for it (`actors`: awaited, the dispatcher's answer)
    if ACTORS:
        return dispatcher.call(Submit((body,)))
    if RULES:
        return rules_submit(body)
    if db is not None:
        commit()
    keeper.send(body + b"\n")
    return b"ok"


async def drain():
    # a burst: each job's end (one line from the keeper) committed, as a runner records
    # it; the done file once all have ended
    s = trio.socket.from_stdlib_socket(keeper)
    ended, buf = 0, b""
    while data := await s.recv(65536):
        if TO_KEEPERD:  # motor's keeperd: one JSON answer a line
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if ACTORS:  # the job's actor waits for it
                    if (waiting := answers.pop(json.loads(line)["id"], None)) is not None:
                        waiting[1] = line
                        waiting[0].set()
                    continue
                if (job_id := watches.pop(json.loads(line)["id"], None)) is not None:
                    rules_ended(job_id)
                    ended += 1
            if burst and ended == burst:
                open(db_path + ".done", "w").close()
        elif burst:
            for _ in range(data.count(b"x")):
                ended += 1
                if RULES:
                    rules_ended()
                elif db is not None:
                    commit()
            if ended == burst:
                open(db_path + ".done", "w").close()

async def ender():
    # a start's run: the keeper tells no ends, the job (`date`) is over well before the
    # next sample; the rules end it between samples, as a runner does
    while True:
        await trio.sleep(0.05)
        while running:
            rules_ended()


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
    answer = handle(body)
    if not isinstance(answer, bytes):  # the actors' dispatcher answers
        answer = await answer
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})

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

async def bare_h11(stream):
    # HTTP/1.1 by h11 alone: each request's body to the keeper, answered 200 "ok"
    conn = h11.Connection(h11.SERVER)
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            answer, body = handle(body), b""
            if not isinstance(answer, bytes):  # the actors' dispatcher answers
                answer = await answer
            await stream.send_all(
                conn.send(h11.Response(status_code=200,
                                       headers=[(b"content-length", str(len(answer)).encode())]))
                + conn.send(h11.Data(data=answer)) + conn.send(h11.EndOfMessage()))
            conn.start_next_cycle()
        elif not isinstance(event, h11.Request):  # ConnectionClosed
            return

async def main():
    ends_untold = RULES and not burst and not TO_KEEPERD  # `ender` ends the starts' jobs
    if variant == "socket-keeper" or variant.startswith("h11-"):
        listener = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await listener.bind(sock_path); listener.listen(8)
        async with trio.open_nursery() as n:
            if ACTORS:  # motor's tree: one supervisor per subsystem, the API last
                await n.start(actors.Supervisor("runner", TREE, intensity=0).run)
            n.start_soon(drain)
            if ends_untold:
                n.start_soon(ender)
            handler = raw if variant == "socket-keeper" else bare_h11
            await trio.serve_listeners(handler, [trio.SocketListener(listener)])
    config = Config(); config.bind = ["unix:" + sock_path]; config.accesslog = None
    async with trio.open_nursery() as n:
        if ACTORS:  # motor's tree: one supervisor per subsystem, the API last
            await n.start(actors.Supervisor("runner", TREE, intensity=0).run)
        n.start_soon(drain)
        if ends_untold:
            n.start_soon(ender)
        await serve(app, config)

if profile_to := os.environ.get("FLOOR_PROFILE"):  # --calls: cProfile from the first request
    import cProfile, signal
    prof, _handle, _on = cProfile.Profile(), handle, []

    def dump(signum, frame):
        prof.disable()
        prof.dump_stats(profile_to)
        os._exit(0)

    def handle(body):
        if not _on:
            _on.append(True)
            prof.enable()
        return _handle(body)

    signal.signal(signal.SIGTERM, dump)

trio.run(main)
"""

#: in both programs that time starts: the job's own timestamp in `out`, minus `t0`, in ms
WAIT_FOR = r"""
import os, time

FRAMED = False  # the job's stdout in motor's output.log (keeperd): `out`.d/output.log


def wait_for(out, t0):
    for _ in range(20000):  # 10 s and more: a start that long is a broken variant
        try:
            if FRAMED:  # one framed record: a 5-byte header, then the text
                with open(os.path.join(os.fsdecode(out) + ".d", "output.log"), "rb") as f:
                    text = f.read()[5:].decode()
            else:
                with open(out) as f:
                    text = f.read()
            if text.endswith("\n"):
                return (float(text) - t0) * 1000
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    raise SystemExit(f"no timestamp in {out}")

"""

EMBEDDED = WAIT_FOR + r"""
import json, os, random, socket, sys
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

trio.run(main)
"""

CLIENT = WAIT_FOR + r"""
import json, os, random, socket, sys, time
sock_path, outdir, samples, gap, form, burst, done = sys.argv[1:8]
samples, gap, raw, burst = int(samples), float(gap), form == "raw", int(burst)
if form == "keeperd":
    FRAMED, form = True, "json"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sock_path)

def body_for(out, i=0):
    # the job: the line the keeper reads, or (rules) a JobRequest carrying it; a burst's
    # jobs over 4 workspaces, as bench/throughput.py's
    if form != "json":
        return out or b"b"
    command = ["/bin/date", "+%s.%N"] if out else ["/bin/true"]
    return json.dumps({"command": command, "workspace": f"ws{i % 4}",
                       "env": {"OUT": out.decode()} if out else {}}).encode()

def post(body):
    s.sendall(b"POST /start HTTP/1.1\r\nhost: floor\r\ncontent-length: %d\r\n\r\n%s"
              % (len(body), body))
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, rest = got.split(b"\r\n\r\n", 1)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += s.recv(65536)
if burst:  # N requests one after another, each answered before the next; then the end
    t0 = time.perf_counter()
    for i in range(burst):
        post(body_for(b"", i))
    while not os.path.exists(done):
        if time.perf_counter() - t0 > 120:
            sys.exit(f"the {burst} jobs had not all ended after 120 s")
        time.sleep(0.0005)
    print(json.dumps(burst / (time.perf_counter() - t0)))
    sys.exit()
lats = []
for i in range(samples):
    time.sleep(gap + random.random() * 0.1)
    out = os.path.join(outdir, f"h{i}").encode()
    body = body_for(out)
    t0 = time.time()
    if raw:
        s.sendall(out + b"\n")
        got = b""
        while not got.endswith(b"ok"):
            got += s.recv(65536)
    else:
        post(body)
    lats.append(wait_for(out, t0))
print(json.dumps(lats))
"""


def wait_ready(proc: subprocess.Popen, path: str, errors: str | None = None) -> None:
    """Until the server's socket appears; else exit saying why, with the end of what the
    server wrote to `errors` (its standard error's file)."""
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            said = ""
            if errors is not None:
                with open(errors, "rb") as f:
                    said = f.read()[-4000:].decode(errors="replace")
            state = "running" if proc.poll() is None else f"exited {proc.returncode}"
            raise SystemExit(f"{path} never appeared (the server {state}): {said}")
        time.sleep(0.01)


def one(variant: str, samples: int, gap: float, burst: int = 0, profile: str | None = None,
        cpu: list | None = None) -> Any:
    """A round of one variant: its start latencies (ms), or with `burst` its jobs/s
    (`profile`: the server's cProfile stats from its first request on, written there;
    `cpu`: gets the server's CPU seconds from its socket's appearance to the last end)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        keeper_path = os.path.join(tmp, "keeper.sock")
        db = os.path.join(tmp, "db.sqlite")
        procs: list[subprocess.Popen] = []
        keeperd_pid, held = None, None
        try:
            if variant.endswith("keeperd"):  # motor's own, detached: its ready line has its pid
                state = os.path.join(tmp, "state")
                os.mkdir(state, 0o700)
                ready = subprocess.run([sys.executable, str(KEEPERD), state],
                                       capture_output=True, text=True, check=True)
                keeperd_pid = json.loads(ready.stdout.splitlines()[0])["pid"]
                keeper_path = os.path.join(state, "keeperd.sock")
                # connected from here to the round's end, as a runner is: keeperd leaves
                # after IDLE_EXIT_S (2 s) with no connection, and a server that took longer
                # to start on a loaded host found no socket (stop 76's server that exited)
                held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                held.connect(keeper_path)
            elif variant != "spawn":
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", KEEPER, keeper_path, TRUE if burst else DATE,
                     str(SLOTS if burst else 0)], stdout=subprocess.PIPE))
                procs[-1].stdout.readline()
            if variant in ("spawn", "keeper"):
                r = subprocess.run([sys.executable, "-c", EMBEDDED, variant, keeper_path, tmp,
                                    str(samples), str(gap), DATE],
                                   capture_output=True, text=True, check=True)
                return json.loads(r.stdout)
            sock = os.path.join(tmp, "api.sock")
            env = dict(os.environ, FLOOR_PROFILE=profile) if profile else None
            errors = None if DEBUG else os.path.join(tmp, "server.err")
            with open(errors or os.devnull, "wb") as err:
                procs.append(subprocess.Popen([sys.executable, "-c", SERVER, variant, sock,
                                               keeper_path, db, str(burst)], env=env,
                                              stderr=None if DEBUG else err))
            wait_ready(procs[-1], sock, errors)
            cpu0 = process_cpu_s(procs[-1].pid)
            r = subprocess.run([sys.executable, "-c", CLIENT, sock, tmp, str(samples), str(gap),
                                "raw" if variant == "socket-keeper" else
                                "keeperd" if variant.endswith("keeperd") else
                                "json" if "rules" in variant else "http", str(burst),
                                db + ".done"], capture_output=True, text=True, check=True)
            if cpu is not None:
                cpu.append(process_cpu_s(procs[-1].pid) - cpu0)
            return json.loads(r.stdout)
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()
            if held is not None:
                held.close()
            if keeperd_pid is not None:
                try:
                    os.kill(keeperd_pid, signal.SIGTERM)
                except ProcessLookupError:  # it had left already
                    pass


def latency_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    meds: dict[str, list[float]] = {v: [] for v in (*VARIANTS, "bare") if v in args.only or v == "bare"}
    for _ in range(args.rounds):
        order = [v for v in VARIANTS if v in args.only]
        random.shuffle(order)
        for variant in order:
            lats = one(variant, args.samples + 2, args.gap)[2:]  # two warm-up starts
            med = statistics.median(lats)
            meds[variant].append(med)
            print(f"peer=floor-{variant} metric=start_latency value={med:.3f} unit=ms "
                  f"samples={len(lats)} min={min(lats):.3f} max={max(lats):.3f} "
                  f"gap_s={args.gap} load1={load1()}", flush=True)
        line = peer_line("latency.sh", ["bare", str(args.samples)], {"LAT_GAP": str(args.gap)})
        if line is not None:
            meds["bare"].append(field(line, "value"))
            print(f"{line} load1={load1()}", flush=True)
    return meds


def burst_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    variants = [v for v in BURST_VARIANTS if v in args.only]
    meds: dict[str, list[float]] = {v: [] for v in (*variants, "tsp")}
    for _ in range(args.rounds):
        for variant in variants:
            rate = one(variant, 0, 0, args.burst, cpu=(cpu := []))
            meds[variant].append(rate)
            print(f"peer=floor-{variant} metric=jobs_per_s value={rate:.1f} n={args.burst} "
                  f"slots={SLOTS} server_cpu_per_job_ms={cpu[0] / args.burst * 1e3:.2f} "
                  f"load1={load1()}", flush=True)
        line = peer_line("throughput.sh", ["tsp", str(args.burst)])
        if line is not None:
            meds["tsp"].append(field(line, "jobs_per_s"))
            print(f"{line} load1={load1()}", flush=True)
    return meds


def calls(args: argparse.Namespace) -> None:
    """Python calls per job in each burst variant's server (cProfile from its first request
    to its end, so its start-up is not counted: counts, not times)."""
    for variant in (v for v in BURST_VARIANTS if v in args.only):
        with tempfile.TemporaryDirectory() as tmp:
            stats = os.path.join(tmp, "server.prof")
            one(variant, 0, 0, args.burst, profile=stats)
            per_job = pstats.Stats(stats).total_calls / args.burst
        print(f"peer=floor-{variant} metric=python_calls_per_job value={per_job:.1f} "
              f"unit=count n={args.burst} load1={load1()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="instead: N jobs of `true` back to back, 2 at a time (jobs/s)")
    ap.add_argument("--calls", action="store_true",
                    help="with --burst: each variant's Python calls per job in its server, once")
    ap.add_argument("--only", metavar="V,V", type=lambda text: text.split(","),
                    default=VARIANTS, help="these variants only (default: all)")
    args = ap.parse_args()
    if unknown := set(args.only) - set(VARIANTS):
        ap.error(f"no such variant: {', '.join(sorted(unknown))}")
    if args.calls and not args.burst:
        ap.error("--calls needs --burst N")
    print(f"# floor: rounds={args.rounds} samples={args.samples} gap_s={args.gap} "
          f"burst={args.burst} calls={args.calls} load1={load1()}", flush=True)
    if args.calls:
        return calls(args)
    meds = burst_rounds(args) if args.burst else latency_rounds(args)
    unit, ref = ("jobs/s", "tsp") if args.burst else ("ms", "bare")
    print(f"# medians over {args.rounds} rounds ({unit}), load1={load1()}")
    base = statistics.median(meds[ref]) if meds[ref] else None
    for v, ms in meds.items():
        if ms:
            ratio = f"  {statistics.median(ms) / base:.2f}x {ref}" if base else ""
            print(f"# {v:20s} {statistics.median(ms):8.3f}{ratio}")


if __name__ == "__main__":
    main()
