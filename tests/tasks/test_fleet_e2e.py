"""End to end: two real `motor serve` workers (mini-1, mini-2) and the real CLI.

Twenty `motor task submit` started at the same moment: sampled every 20 ms, never more than
two detached runner processes alive; every turn executed exactly once; all succeed.  Then a
detached runner is killed with SIGKILL mid-turn and `motor task reconcile` replaces it: the
turn finishes once, never twice."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from motor.tasks import core
from motor.tasks.store import ClientDir
from tests.conftest import ROOT, motor_env
from tests.polling import wait_for

pytestmark = pytest.mark.e2e


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def runner_processes(cdir: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if (p.info["status"] != psutil.STATUS_ZOMBIE and "worker" in cmd and "runner" in cmd
                    and str(cdir) in cmd):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _who(p: psutil.Process) -> str:
    """A counted process's parent, state and age (what tells a real extra runner from a
    fork not yet exec'd or a process dying)."""
    try:
        return f"ppid={p.ppid()} status={p.status()} age={time.time() - p.create_time():.3f}s"
    except psutil.Error as exc:
        return f"({type(exc).__name__})"


class Sampler:
    """Counts live detached runner processes every 20 ms in a thread.

    One pass over /proc sees each process at a different instant (under load a pass can
    outlast a runner's death and its replacement's start), so a count above the best so far
    is checked again: the processes of the pass still alive together, right after it.
    `max_detail` keeps what that count saw (pid, parent, state and age, cmdline), for the
    assertion's message."""

    def __init__(self, cdir: Path):
        self.cdir = cdir
        self.max_seen = 0
        self.max_detail: list[tuple[int, str, list[str]]] = []
        self.samples = 0
        self.max_at = 0.0  # time.monotonic() of the last new maximum
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            procs = runner_processes(self.cdir)
            self.pids.update(p.pid for p in procs)
            if len(procs) > self.max_seen:
                procs = [p for p in procs if _alive(p)]
            if len(procs) > self.max_seen:
                self.max_seen = len(procs)
                self.max_detail = [(p.pid, _who(p), p.info["cmdline"]) for p in procs]
                self.max_at = time.monotonic()
            self.samples += 1
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def fleet(serve_factory, tmp_path):
    workers = [serve_factory("--isolation", "none", state_dir=tmp_path / name).start()
               for name in ("mini-1", "mini-2")]
    cdir = tmp_path / "client"
    cdir.mkdir()
    (cdir / "workers.toml").write_text("".join(
        f'[[workers]]\nname = "mini-{i + 1}"\nendpoint = "unix:{w.socket}"\n\n' for i, w in enumerate(workers)))
    project = tmp_path / "project"
    project.mkdir()
    (project / "Makefile").write_text("all:\n\ttrue\n")
    yield cdir, project
    for p in runner_processes(cdir):  # a failed test leaves no runner behind
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def task_cli(cdir: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=motor_env(), cwd=ROOT, **kw)


def run_cli(cdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), *args],
                          capture_output=True, env=motor_env(), cwd=ROOT, timeout=60)


def all_done(cdir: Path, ids: list[str]):
    c = ClientDir(cdir)
    tasks = [c.read_task(i) for i in ids]
    return all(t is not None and t.state in ("succeeded", "failed", "cancelled", "lost", "refused")
               for t in tasks) and tasks


def test_twenty_simultaneous_submits_run_each_turn_once_with_at_most_two_runners(fleet, tmp_path):
    cdir, project = fleet
    executed = tmp_path / "executed.txt"
    with Sampler(cdir) as sampler:
        procs = [task_cli(cdir, "submit", "--project", str(project), "--",
                          "sh", "-c", f'echo "$MOTOR_TASK" >> {executed}; test -f Makefile')
                 for _ in range(20)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [(p.returncode, o[1].decode()) for p, o in zip(procs, outs) if p.returncode]
        ids = [o[0].decode().strip() for o in outs]
        tasks = wait_for(lambda: all_done(cdir, ids), timeout=120, what="all twenty tasks to end")
        wait_for(lambda: not runner_processes(cdir), timeout=30, what="runners to exit")
    assert [t.state for t in tasks] == ["succeeded"] * 20, [(t.task_id, t.current) for t in tasks]
    lines = executed.read_text().split()
    assert sorted(lines) == sorted(ids) and len(set(lines)) == 20
    assert sampler.max_seen <= 2 and sampler.samples > 10, sampler.max_detail
    assert sampler.pids, "no detached runner was ever seen"
    assert {t.current.worker for t in tasks} <= {"mini-1", "mini-2"}
    assert all((cdir / "turns" / i / "1" / "record.json").exists() for i in ids)
    queue = json.loads((cdir / "queue.json").read_text())
    assert queue.get("entries", []) == []


def test_kill_9_of_a_runner_mid_turn_then_reconcile_finishes_the_turn_once(fleet, tmp_path):
    cdir, project = fleet
    executed = tmp_path / "executed.txt"
    go = tmp_path / "go"
    script = f'echo "$MOTOR_TASK" >> {executed}; while [ ! -e {go} ]; do sleep 0.05; done; echo done'
    with Sampler(cdir) as sampler:
        procs = [task_cli(cdir, "submit", "--project", str(project), "--", "sh", "-c", script) for _ in range(3)]
        ids = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
        c = ClientDir(cdir)

        def two_running():
            running = [i for i in ids if (t := c.read_task(i)) and t.current.state == "running"]
            return running if len(running) == 2 else None

        running = wait_for(two_running, timeout=60, what="two turns running")
        victim_task = random.choice(running)
        victim = c.read_runners()[victim_task].identity.pid
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE,
                 what="the runner to die")
        result = run_cli(cdir, "reconcile")
        assert result.returncode == 0, result.stderr.decode()
        assert b"started 1 runner" in result.stdout
        go.touch()
        tasks = wait_for(lambda: all_done(cdir, ids), timeout=90, what="all tasks to end")
        wait_for(lambda: not runner_processes(cdir), timeout=30, what="runners to exit")
    assert [t.state for t in tasks] == ["succeeded"] * 3
    assert sorted(executed.read_text().split()) == sorted(ids)       # each command ran once
    victim_turn = c.turn_dir(victim_task, "1")
    assert (victim_turn / "output.log").read_text().endswith("done\n")
    assert sampler.max_seen <= 2, (  # all of it: when, and which processes (stops 22, 26)
        f"victim {victim}; the maximum seen {sampler.max_at - killed_at:+.3f} s from the kill:\n"
        + "\n".join(f"{pid} {who} {' '.join(cmd)}" for pid, who, cmd in sampler.max_detail))


def test_submit_killed_between_the_two_publishes_still_runs_the_turn_once(fleet, tmp_path):
    """MOTOR_TASK_FAULT=complete_between_publishes: the submitting CLI dies right after the
    first publish (child bound, reservation present, no task.runner yet).  The slot stays
    occupied through the bound reservation and the child completes the handoff itself."""
    cdir, project = fleet
    executed = tmp_path / "executed.txt"
    r = subprocess.run([sys.executable, "-m", "motor", "task", "--client-dir", str(cdir), "submit",
                        "--project", str(project), "--", "sh", "-c", f'echo "$MOTOR_TASK" >> {executed}'],
                       capture_output=True, env=motor_env({"MOTOR_TASK_FAULT": "complete_between_publishes"}),
                       cwd=ROOT, timeout=60)
    assert r.returncode == 86, r.stderr.decode()          # died at the fault point, printed nothing
    c = ClientDir(cdir)
    [task] = c.list_tasks()
    tasks = wait_for(lambda: all_done(cdir, [task.task_id]), timeout=60, what="the turn to end")
    assert tasks[0].state == "succeeded"
    assert executed.read_text().split() == [task.task_id]
    wait_for(lambda: not runner_processes(cdir), timeout=30, what="the runner to exit")
    assert c.read_queue().entries == [] and c.read_runners() == {}


def test_saturated_pool_runs_a_parked_mini2_task_with_a_donor_pid_end_to_end(fleet, tmp_path):
    """Seed 001 end to end: mini-1 runs a long turn, a second mini-1 task has the other
    runner process (waiting: its worker is busy), a third mini-1 task and a mini-2 task are
    parked (cap 2).  The waiting runner donates its process: the mini-2 task finishes while
    mini-1's turn still runs, with no third runner process ever."""
    cdir, project = fleet
    go = tmp_path / "go"
    hold = f'while [ ! -e {go} ]; do sleep 0.05; done; echo held'
    c = ClientDir(cdir)

    # the mini-2 task is another project: a linked git worktree (the recipient's own context)
    repo, linked = tmp_path / "repo", tmp_path / "linked"
    repo.mkdir()
    genv = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                GIT_COMMITTER_EMAIL="t@t")
    for args in (["init", "-q", "-b", "main"], ["commit", "-q", "--allow-empty", "-m", "one"],
                 ["worktree", "add", "-q", "-b", "side", str(linked)]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=genv)
    (linked / "file").write_text("linked worktree\n")
    (project / "file").write_text("donor project\n")

    def submit(pin, script, where=project):
        r = run_cli(cdir, "submit", "--project", str(where), "--pin", pin, "--", "sh", "-c", script)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode().strip()

    def state(task_id):
        t = c.read_task(task_id)
        return t.current.state if t else None

    with Sampler(cdir) as sampler:
        a = submit("mini-1", hold)
        wait_for(lambda: state(a) == "running", timeout=60, what="mini-1's turn to run")
        b = submit("mini-1", "echo b")
        wait_for(lambda: (row := core.find_row(c.read_queue(), b, "1")) is not None
                 and row.state == "waiting" and row.owner != row.enqueue_owner,
                 timeout=60, what="the second runner to wait for mini-1")
        third = submit("mini-1", "echo c")
        d = submit("mini-2", "cat file", linked)
        assert state(third) == "parked" and state(d) in ("parked", "dispatching", "running", "succeeded")
        wait_for(lambda: state(d) == "succeeded", timeout=60, what="the mini-2 task to finish")
        assert state(a) == "running"                        # before mini-1's running turn ends
        turn = c.read_task(d).current
        assert turn.worker == "mini-2" and turn.donated_from == b
        assert (c.turn_dir(d, "1") / "output.log").read_text() == "linked worktree\n"
        shown = run_cli(cdir, "show", d)
        assert f"donated by task {b}" in shown.stdout.decode()
        go.touch()
        tasks = wait_for(lambda: all_done(cdir, [a, b, third, d]), timeout=120, what="all tasks to end")
        wait_for(lambda: not runner_processes(cdir), timeout=30, what="runners to exit")
    assert [t.state for t in tasks] == ["succeeded"] * 4
    assert [t.current.worker for t in tasks] == ["mini-1", "mini-1", "mini-1", "mini-2"]
    assert sampler.max_seen <= 2 and sampler.samples > 10, sampler.max_detail
    assert c.read_queue().entries == []


def test_a_turns_output_log_holds_exactly_the_bytes_its_job_wrote(fleet, tmp_path):
    """Stop 58: bytes that are not UTF-8 (and a character the output's end cuts short)
    reached `C/turns/<task>/<turn>/output.log` as U+FFFD, or not at all; now exact."""
    cdir, project = fleet
    submit = task_cli(cdir, "submit", "--project", str(project), "--",
                      "printf", "ok \\377 caf\\303\\251 \\303")
    out, err = submit.communicate(timeout=60)
    assert submit.returncode == 0, err.decode()
    task_id = out.decode().strip()
    [task] = wait_for(lambda: all_done(cdir, [task_id]), timeout=60, what="the task to end")
    assert task.state == "succeeded"
    log = ClientDir(cdir).turn_dir(task_id, "1") / "output.log"
    assert log.read_bytes() == b"ok \xff caf\xc3\xa9 \xc3"
