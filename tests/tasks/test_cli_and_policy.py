"""The task CLI's bad-input answers, pins, max_parallel per run, and worker choice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from motor.tasks import core
from motor.tasks.client import TaskClient
from motor.tasks.queue import open_queue
from motor.tasks.records import QueueFile, RunnerRecord
from motor.tasks.sections import reconcile_plan
from motor.tasks.store import ClientDir, ClientDirError
from motor.tasks.workers import Fleet, FleetError, WorkerSpec, load_fleet
from tests.conftest import ROOT, motor_env, read_only_tmpfs
from tests.tasks.test_fleet_e2e import fleet, runner_processes  # noqa: F401 (fleet is a fixture)
from tests.polling import wait_for


def task(cdir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), *args],
                          capture_output=True, text=True, env=motor_env(), cwd=ROOT, timeout=timeout)


def workers_toml(cdir: Path, text: str) -> None:
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / "workers.toml").write_text(text)


GOOD = '[[workers]]\nname = "mini-1"\nendpoint = "unix:/nonexistent/mini-1.sock"\n'


def test_malformed_workers_toml_names_file_and_line(tmp_path):
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD + '\n[[workers]]\nname = "mini-2"\nendpoint = \n')
    r = task(cdir, "submit", "--project", str(tmp_path), "--", "true")
    assert r.returncode == 2
    assert r.stderr.startswith(f"motor: error: {cdir / 'workers.toml'}:7: ") and r.stderr.count("\n") == 1
    workers_toml(cdir, GOOD + '\n[[workers]]\nname = "mini-2"\nendpoint = "ftp://x"\n')
    with pytest.raises(FleetError, match=r"workers.toml:5: worker mini-2: endpoint must be"):
        load_fleet(cdir / "workers.toml")
    (cdir / "workers.toml").unlink()
    r = task(cdir, "list")
    assert r.returncode == 0          # list needs no fleet
    r = task(cdir, "reconcile")
    assert r.returncode == 2 and "workers.toml: no such file" in r.stderr
    assert not (cdir / "tasks").exists() or not list((cdir / "tasks").iterdir())


def test_unknown_worker_unknown_task_and_project_not_a_directory(tmp_path):
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD)
    r = task(cdir, "submit", "--project", str(tmp_path), "--pin", "mini-9", "--", "true")
    assert r.returncode == 2 and "unknown worker 'mini-9'" in r.stderr and "mini-1" in r.stderr
    r = task(cdir, "submit", "--project", str(tmp_path / "nope"), "--", "true")
    assert r.returncode == 2 and "not a directory" in r.stderr
    for args in (("show", "deadbeef"), ("wait", "deadbeef"), ("cancel", "deadbeef"), ("turn", "deadbeef", "--", "x")):
        r = task(cdir, *args)
        assert r.returncode == 2 and "unknown task deadbeef" in r.stderr, (args, r.stderr)
    assert ClientDir(cdir).list_tasks() == []          # nothing half-written
    assert ClientDir(cdir).read_queue().entries == []


def test_unreachable_worker_is_named_and_the_turn_stays_queued(tmp_path):
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD)
    r = task(cdir, "submit", "--project", str(tmp_path), "--", "true")
    assert r.returncode == 69
    assert "worker mini-1 unreachable at unix:/nonexistent/mini-1.sock" in r.stderr
    task_id = r.stdout.strip()
    rows = ClientDir(cdir).read_queue().entries
    assert [(e.task_id, e.state) for e in rows] == [(task_id, "parked")]
    assert not runner_processes(cdir)


def test_pins_keep_a_task_on_its_worker_and_turns_run_in_order(fleet, tmp_path):  # noqa: F811
    cdir, project = fleet
    out = tmp_path / "order.txt"
    r = task(cdir, "submit", "--project", str(project), "--pin", "mini-2", "--",
             "sh", "-c", f"echo first >> {out}")
    assert r.returncode == 0, r.stderr
    task_id = r.stdout.strip()
    r2 = task(cdir, "turn", task_id, "--", "sh", "-c", f"echo second >> {out}; exit 4")
    assert r2.returncode == 0, r2.stderr
    w = task(cdir, "wait", task_id, timeout=120)
    assert w.returncode == 4, w.stderr
    t = ClientDir(cdir).read_task(task_id)
    assert [(x.state, x.worker) for x in t.turns] == [("succeeded", "mini-2"), ("failed", "mini-2")]
    assert out.read_text() == "first\nsecond\n"
    show = task(cdir, "show", task_id, "--json")
    assert '"exit_code": 4' in show.stdout
    wait_for(lambda: not runner_processes(cdir), timeout=30, what="runners to exit")


async def test_max_parallel_per_run_parks_the_turns_over_the_limit(tmp_path, procs, tokens):
    from tests.tasks.test_reservation import fleet as make_fleet
    from motor.tasks.workers import Fleet

    fl = Fleet(make_fleet(3).workers, max_parallel={"nightly": 1})
    cdir = ClientDir(tmp_path / "c", observe=procs)
    async with trio.open_nursery() as n:
        queue = await open_queue(n, cdir)
        tc = TaskClient(cdir, queue, fl, me=procs.spawn(), spawner=lambda *a: procs.spawn(), token_source=tokens)
        a = await tc.create_task(str(tmp_path), ["x"], run="nightly")
        b = await tc.create_task(str(tmp_path), ["x"], run="nightly")
        c = await tc.create_task(str(tmp_path), ["x"])
        outcomes = [(await tc.start_turn(*k)).outcome for k in (a, b, c)]
        n.cancel_scope.cancel()
    assert outcomes == ["spawned", "parked", "spawned"]     # cap 3 had room; the run did not


def test_worker_choice_prefers_fewer_turns_in_flight_then_the_idler_runner(procs):
    q = QueueFile()
    owner = procs.spawn()
    core.enqueue(q, task_id="a", turn_id="1", owner=owner, now_ms=1)
    core.begin_dispatch(q, task_id="a", turn_id="1", me=owner, worker="mini-1")
    busy = {"capacity": {"pending_jobs": 3, "held_permits": 8}}
    idle = {"capacity": {"pending_jobs": 0, "held_permits": 0}}
    assert core.pick_worker(q, {"mini-1": idle, "mini-2": busy}) == "mini-2"   # one of ours is on mini-1
    assert core.pick_worker(QueueFile(), {"mini-1": busy, "mini-2": idle}) == "mini-2"
    assert core.pick_worker(QueueFile(), {}) is None


def test_attached_turn_streams_here_and_cancel_ends_a_running_turn(fleet, tmp_path):  # noqa: F811
    cdir, project = fleet
    r = task(cdir, "submit", "--attached", "--project", str(project), "--", "sh", "-c", "echo attached-out; exit 5")
    assert r.returncode == 5, r.stderr
    assert r.stdout == "attached-out\n"
    assert runner_processes(cdir) == []                  # attached: no detached runner
    started = tmp_path / "started"
    r = task(cdir, "submit", "--project", str(project), "--",
             "sh", "-c", f"touch {started}; exec sleep 300")
    task_id = r.stdout.strip()
    wait_for(lambda: started.exists() and ClientDir(cdir).read_task(task_id).current.state == "running",
             timeout=60, what="the turn to run")
    assert task(cdir, "cancel", task_id).returncode == 0
    w = task(cdir, "wait", task_id, timeout=120)
    assert w.returncode == 130
    assert ClientDir(cdir).read_task(task_id).current.state == "cancelled"
    wait_for(lambda: not runner_processes(cdir), timeout=30, what="runners to exit")


def test_process_identity_oracle_tells_live_gone_recycled_and_zombie(tmp_path):
    import os

    from motor.tasks.records import ProcessIdentity
    from motor.tasks.store import identity_of, observe_process

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ident = identity_of(child.pid)
        assert observe_process(ident) == "matching"
        recycled = ProcessIdentity(pid=child.pid, start_time_micros=ident.start_time_micros - 5_000_000)
        assert observe_process(recycled) == "mismatch"
        child.stdin.close()
        wait_for(lambda: observe_process(ident) == "gone", what="the exited (zombie) child to read as gone")
    finally:
        child.wait(10)
    assert observe_process(ident) == "gone"
    assert observe_process(identity_of(os.getpid())) == "matching"


def test_detached_runner_with_a_stale_token_refuses_and_exits(tmp_path):
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD)
    r = task(cdir, "submit", "--project", str(tmp_path), "--", "true")   # unreachable: parked
    task_id = r.stdout.strip()
    before = (cdir / "queue.json").read_bytes()
    w = subprocess.run([sys.executable, "-m", "motor", "worker", "runner", task_id, "1",
                        "--slot-token", "018f0f4a-6b5c-7d8e-9f00-112233445566", "--client-dir", str(cdir)],
                       capture_output=True, text=True, env=motor_env(), cwd=ROOT, timeout=60)
    assert w.returncode == 3
    assert "refused: QUEUE_SLOT_TOKEN_MISMATCH" in w.stderr
    assert (cdir / "queue.json").read_bytes() == before
    assert ClientDir(cdir).read_runners() == {}


def test_capabilities_limit_which_workers_a_task_may_use(tmp_path):
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD + '\n[[workers]]\nname = "mini-2"\nendpoint = "unix:/nonexistent/mini-2.sock"\n'
                        'capabilities = ["gpu"]\n')
    r = task(cdir, "submit", "--project", str(tmp_path), "--capability", "tpu", "--", "true")
    assert r.returncode == 2 and "no worker in workers.toml lists capability tpu" in r.stderr
    r = task(cdir, "submit", "--project", str(tmp_path), "--pin", "mini-1", "--capability", "gpu", "--", "true")
    assert r.returncode == 2 and "worker 'mini-1' lacks capability gpu" in r.stderr
    r = task(cdir, "submit", "--project", str(tmp_path), "--capability", "gpu", "--", "true")
    assert r.returncode == 69
    assert "worker mini-2 unreachable" in r.stderr and "mini-1" not in r.stderr   # only capable workers tried
    assert ClientDir(cdir).read_task(r.stdout.strip()).capabilities == ["gpu"]


def test_a_client_dir_that_cannot_be_written_is_named_in_one_line(tmp_path):
    """A client dir on a read-only file system (or one the user may not write): every task
    command that writes says so in one line and exits 2 (before stop 50: a traceback)."""
    cdir = tmp_path / "ro"
    with read_only_tmpfs(cdir) as writable:
        writable()
        workers_toml(cdir, GOOD)
        subprocess.run(["mount", "-o", "remount,ro", str(cdir)], check=True)
        for args in (("reconcile",), ("submit", "--project", str(tmp_path), "--", "true")):
            r = task(cdir, *args)
            assert r.returncode == 2, (args, r.stderr)
            assert r.stderr.startswith(f"motor: error: client dir {cdir} cannot be used ("), r.stderr
            assert "Read-only file system" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_damaged_queue_or_task_file_is_named_in_one_line_and_left_as_it_is(tmp_path):
    """Before stop 48 a queue.json that was not a queue made every task command end in a
    traceback. Now each names the file, changes nothing, and exits 2."""
    cdir = tmp_path / "c"
    workers_toml(cdir, GOOD)
    (cdir / "queue.json").write_text("[1, 2]")
    for args in (("queue",), ("reconcile",), ("submit", "--project", str(tmp_path), "--", "true")):
        r = task(cdir, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(f"motor: error: {cdir / 'queue.json'} cannot be read ("), r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert (cdir / "queue.json").read_text() == "[1, 2]"  # not rewritten
    (cdir / "queue.json").write_text("")  # empty (a crash before the first publish): no queue
    assert task(cdir, "queue").returncode == 0
    (cdir / "tasks").mkdir(exist_ok=True)
    (cdir / "tasks" / "deadbeef.json").write_text('{"task_id": 5}')
    r = task(cdir, "show", "deadbeef")
    assert r.returncode == 2 and "deadbeef.json cannot be read" in r.stderr, r.stderr
    assert task(cdir, "list").returncode == 0  # the list leaves out what it cannot read
    (cdir / "runners").mkdir(exist_ok=True)
    (cdir / "runners" / "deadbeef.json").write_text('{"identity": 5, "turn_id": "1"}')
    for args in (("reconcile",), ("queue",), ("submit", "--project", str(tmp_path), "--", "true")):
        r = task(cdir, *args)
        if args == ("queue",):
            assert r.returncode == 0, r.stderr  # a snapshot of the queue reads no runner record
            continue
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith(f"motor: error: {cdir / 'runners' / 'deadbeef.json'} cannot be read ("), r.stderr
    assert (cdir / "runners" / "deadbeef.json").read_text() == '{"identity": 5, "turn_id": "1"}'


async def test_a_damaged_runner_record_is_never_read_as_no_runner(tmp_path, procs, tokens, nursery):
    """A detached runner's only trace in the queue, once its CLI has exited, is its
    task.runner record. Before stop 49 a record that could not be read was skipped, and
    reconcile reserved a slot for a second runner of the same turn while the first still
    ran. Now the critical section refuses, and the queue is left as it was."""
    cdir = ClientDir(tmp_path / "c", observe=procs)
    fl = Fleet((WorkerSpec("mini-1", "unix:/nonexistent/mini-1.sock"),), {})
    tc = TaskClient(cdir, await open_queue(nursery, cdir), fl, me=procs.spawn(),
                    token_source=tokens, spawner=lambda *a: procs.spawn())
    (tmp_path / "project").mkdir()
    t, _ = await tc.create_task(str(tmp_path / "project"), ["true"])
    cli, runner = procs.spawn(), procs.spawn()

    def running(L):
        row = core.require_row(L.queue, t, "1")
        row.state, row.owner, row.worker = "waiting", cli, "mini-1"
        L.set_runner(t, RunnerRecord(identity=runner, turn_id="1"))
    cdir.critical(running)
    procs.kill(cli)                                   # the submitting CLI exited; the runner runs
    assert cdir.critical(lambda L: reconcile_plan(L, procs.spawn(), 2, {}, tokens)) == []
    cdir.runner_path(t).write_text('{"identity": {"pid": "x"}, "turn_id": "1"}')
    before = cdir.queue_path.read_bytes()
    with pytest.raises(ClientDirError, match=r"runners/.*\.json cannot be read"):
        cdir.critical(lambda L: reconcile_plan(L, procs.spawn(), 2, {}, tokens))
    assert cdir.queue_path.read_bytes() == before     # no reservation for a second runner
