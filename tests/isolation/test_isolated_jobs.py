"""Jobs under the cgroup backend through a real `motor serve`, checked from inside the job."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from isolation_helpers import counter, cgroup_unavailable, needs_cgroups, remove_parent
from motor.execution.spares import DEFAULT_SIZE, SIZE_ENV
from motor.isolation.cgroup import open_cgroup_backend
from polling import wait_for

pytestmark = [pytest.mark.e2e, needs_cgroups]

INSIDE = r"""
import json, os
cpus = open("/proc/self/status").read().split("Cpus_allowed_list:")[1].split()[0]
rel = [l.split(":", 2)[2] for l in open("/proc/self/cgroup").read().splitlines()
       if l.split(":", 2)[1] in ("memory",) or l.startswith("0::")][0]
for name in ("memory.limit_in_bytes", "memory.max"):
    path = "/sys/fs/cgroup/memory" + rel + "/" + name
    if not os.path.exists(path):
        path = "/sys/fs/cgroup" + rel + "/" + name
    if os.path.exists(path):
        limit = int(open(path).read().strip())
        break
print(json.dumps({"cpus": cpus, "memory_limit": limit, "group": rel}))
"""


def _groups_gone(backend, *job_ids: str) -> bool:
    """None of the jobs has a group left in any hierarchy. Not `backend.adopt`, which is
    false once the first of a v1 job's groups has gone: keeperd's thread removes (or renames
    to a spare) the cpuset, memory and cpuacct groups one after another."""
    return not backend.flavour.listed() & set(job_ids)


@pytest.fixture
def private_parent():
    parent = f"motor-test-{os.getpid()}-{next(counter)}"
    yield parent
    try:
        remove_parent(open_cgroup_backend(parent=parent))
    except Exception:  # noqa: BLE001 - best effort cleanup of a group that may not exist
        pass


def test_isolated_four_vcpus_enforce_cpu_set_and_memory_max(serve_factory, private_parent):
    """The seed's operator-only test, run where the host allows it: the cgroup backend on
    this host's real topology, with the largest claim that fits (4 vCPUs where there are
    4 allocatable CPUs, else the host's claim limit)."""
    assert cgroup_unavailable() is None
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent).start()
    health = serve.cli_json("health")
    assert health["isolation"]["backend"] == "cgroup"
    assert set(health["isolation"]["enforces"]) >= {"cpus", "memory"}
    claim = min(4, health["capacity"]["claim_limit"])
    memory_max = 256 * 1024 * 1024
    result = serve.cli("run", "--json", "--weight", str(claim), "--memory-max", str(memory_max),
                       "--", "python3", "-c", INSIDE)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.decode().splitlines()]
    record = events[-1]["record"]
    inside = json.loads("".join(e["data"] for e in events if e["event"] == "output"))
    assert len(record["cpus"]) == claim
    expected = ",".join(map(str, record["cpus"]))
    allowed = inside["cpus"]
    assert allowed in (expected, f"{record['cpus'][0]}-{record['cpus'][-1]}"), (allowed, expected)
    assert inside["memory_limit"] == record["memory_max_bytes"] == memory_max
    assert private_parent in inside["group"] and record["job_id"] in inside["group"]

    # exceeding the limit ends as the kernel's OOM kill, reported as oom_killed
    hog = serve.cli("run", "--json", "--weight", "1", "--memory-max", str(64 * 1024 * 1024), "--",
                    "python3", "-c", "b = bytearray(512 * 1024 * 1024); print(len(b))")
    terminal = json.loads(hog.stdout.decode().splitlines()[-1])["record"]
    assert terminal["state"] == "failed"
    assert terminal["reason"] == "oom_killed", terminal
    assert terminal["signal"] == 9
    assert hog.returncode == 128 + 9

    # keeperd read both jobs' facts from their groups (stop 46): the runner took the OOM
    # verdict and the CPU time from status.json, reading none of the groups itself
    jobs = serve.state_dir / "jobs"
    for done, oom in ((record, False), (terminal, True)):
        facts = json.loads((jobs / done["job_id"] / "status.json").read_text())["isolation_facts"]
        assert facts["oom_killed"] is oom and (facts["oom_kills"] > 0) is oom, facts
        assert facts["memory_max"] == done["memory_max_bytes"], (facts, done)
        assert facts["cpu_time_ms"] == done["reservation_use"]["cpu_time_ms"], (facts, done)


def test_start_up_sweep_removes_a_leftover_group_and_keeps_the_running_jobs(
        serve_factory, private_parent, tmp_path):
    """A job group the store does not know (a runner crashed mid-cleanup, a state dir
    reset) is killed and removed when the runner starts; a running job's group stays."""
    import subprocess

    barrier = tmp_path / "go"
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent).start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"while [ ! -e {barrier} ]; do sleep 0.02; done")["job_id"]
    wait_for(lambda: (serve.state_dir / "jobs" / job_id / "keeper.json").exists(), what="start")
    serve.kill9()
    backend = open_cgroup_backend(parent=private_parent)
    known = [os.path.dirname(p) for p in backend.flavour.create(job_id, None, None)["procs"]]
    leftover = [os.path.dirname(p)
                for p in backend.flavour.create("forgotten-1", None, None)["procs"]]
    (serve.state_dir / "jobs" / "forgotten-1").mkdir()  # a job of this state dir
    # a group of a job this state dir never held: another runner's on the same parent
    foreign = [os.path.dirname(p)
               for p in backend.flavour.create("other-runner-1", None, None)["procs"]]
    sleeper = subprocess.Popen(["sleep", "1000"])
    neighbour = subprocess.Popen(["sleep", "1000"])
    try:
        for paths, proc in ((leftover, sleeper), (foreign, neighbour)):
            for path in paths:
                with open(os.path.join(path, "cgroup.procs"), "w") as f:
                    f.write(str(proc.pid))
        serve.start()
        assert sleeper.wait(10) == -9
        assert not any(os.path.exists(p) for p in leftover)
        assert all(os.path.isdir(p) for p in known)
        assert all(os.path.isdir(p) for p in foreign) and neighbour.poll() is None
        log = serve.log.read_bytes()
        assert b"start-up sweep: group job-forgotten-1" in log
        assert b"left alone: 1 group(s)" in log and b"other-runner-1" in log
        barrier.touch()
        assert serve.cli("attach", job_id).returncode == 0
    finally:
        for proc in (sleeper, neighbour):
            proc.kill()
            proc.wait()


def test_on_v1_a_job_is_a_pre_placed_spare_already_in_its_groups(serve_factory, private_parent):
    """`motor serve --isolation cgroup` on cgroup v1: the runner leaves the job's groups to
    keeperd (spec `cgroup_make`), which keeps spare threads already inside spare groups
    under the parent, a full pool of them from the runner's start (keeperd's "prepare", stop
    64: before, the first job forked and joined the old way). A job is spawned by one of
    those spares: it is keeperd's child, inside the job's own groups (one of the
    spare groups, renamed) from its first instruction, with its limits, and alone there;
    its record is as before (docs/isolation.md, "The join")."""
    from keeper_tracking import ask_keeperd

    backend = open_cgroup_backend(parent=private_parent)
    if backend.version != 1:
        pytest.skip("spares are for cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent).start()
    pool = ask_keeperd(serve.state_dir, "spares")  # the start waited for it: full, no job yet
    assert (len(pool["ready"]), pool["joining"], pool["taken"]) == (DEFAULT_SIZE, [], 0), pool
    result = serve.cli("run", "--json", "--weight", "1", "--memory-max", str(128 << 20), "--",
                       "sh", "-c", "echo $PPID; cat /proc/self/cgroup; "
                       "for c in cpuset memory cpuacct; do echo listed $(cat "
                       "/sys/fs/cgroup/$c$(grep :$c: /proc/self/cgroup | cut -d: -f3)/cgroup.procs); "
                       "done")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.decode().splitlines()]
    record = events[-1]["record"]
    out = "".join(e["data"] for e in events if e["event"] == "output").splitlines()
    keeper = json.loads((serve.state_dir / "jobs" / record["job_id"] / "keeper.json").read_text())
    assert int(out[0]) == keeper["keeper_pid"]  # keeperd's child
    listed = [line.split()[1:] for line in out if line.startswith("listed ")]
    assert len(listed) == 3 and all(str(keeper["keeper_pid"]) not in pids for pids in listed), out
    pool = ask_keeperd(serve.state_dir, "spares")
    assert (pool["taken"], pool["missed"]) == (1, 0), pool  # spawned by a spare
    groups = {name: path for line in out[1:] if not line.startswith("listed ")
              for _, names, path in [line.split(":", 2)] for name in names.split(",")}
    want = f"/{private_parent}/job-{record['job_id']}"
    assert [groups[c] for c in ("cpuset", "memory", "cpuacct")] == [want] * 3
    assert record["state"] == "succeeded" and record["memory_max_bytes"] == 128 << 20
    wait_for(lambda: _groups_gone(backend, record["job_id"]), what="its groups removed (release)")


def test_a_job_from_a_spare_outlives_a_killed_runner_and_is_adopted(
        serve_factory, private_parent, tmp_path):
    """A job started from a spare is kept like any other: the runner is kill -9'd while
    it runs, the restarted runner adopts it, and it ends with its own exit status (keeperd,
    whose child it is, saw it end)."""
    from keeper_tracking import ask_keeperd

    if open_cgroup_backend(parent=private_parent).version != 1:
        pytest.skip("spares are for cgroup v1 hierarchies")
    barrier = tmp_path / "go"
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent).start()
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"echo $$; while [ ! -e {barrier} ]; do sleep 0.02; done; exit 7")["job_id"]
    keeper = serve.state_dir / "jobs" / job_id / "keeper.json"
    wait_for(lambda: keeper.exists() and json.loads(keeper.read_text()).get("job_pid"),
             what="the job's pid in keeper.json")
    assert ask_keeperd(serve.state_dir, "spares")["taken"] == 1  # spawned by a spare
    job_pid = json.loads(keeper.read_text())["job_pid"]
    serve.kill9()
    serve.start()
    barrier.touch()
    result = serve.cli("attach", job_id)
    assert result.returncode == 7, result.stderr
    assert int(result.stdout.decode().split()[0]) == job_pid


GONE = b"its isolation group is gone"


def test_a_job_that_ended_while_no_runner_ran_is_adopted_without_a_warning_of_its_groups(
        serve_factory, private_parent, tmp_path):
    """Stop 58 (a crash probe): keeperd removes an ended job's groups once its status.json
    is written, so a job that ended while the runner was down has none left when the next
    runner adopts it. That is no fault, and is not logged as one (it was, for every such
    job); a running job whose groups were taken from under it still is."""

    backend = open_cgroup_backend(parent=private_parent)
    if backend.version != 1:
        pytest.skip("keeperd makes (and removes) the groups on cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent).start()
    ended, runs = tmp_path / "ended", tmp_path / "runs"
    wait = "while [ ! -e {} ]; do sleep 0.02; done"
    a = serve.cli_json("submit", "--weight", "1", "--workspace", "a", "--", "sh", "-c", wait.format(ended) + "; exit 7")
    b = serve.cli_json("submit", "--weight", "1", "--workspace", "b", "--", "sh", "-c", wait.format(runs))
    jobs = serve.state_dir / "jobs"
    keepers = [jobs / j["job_id"] / "keeper.json" for j in (a, b)]
    wait_for(lambda: all(k.exists() and json.loads(k.read_text()).get("job_pid") for k in keepers),
             what="both jobs' pids in their keeper.json")
    serve.kill9()
    ended.touch()  # a ends: keeperd writes its status, then removes its groups
    wait_for(lambda: (jobs / a["job_id"] / "status.json").exists() and _groups_gone(backend, a["job_id"]),
             what="the first job's status written and its groups removed")
    # b's groups are taken from under it: its processes moved to the parent, the groups removed
    for path in backend.flavour.job_dirs(b["job_id"]).values():
        _empty_into_parent(Path(path))
        os.rmdir(path)
    seen = serve.log.stat().st_size
    serve.start()
    assert serve.cli("attach", a["job_id"]).returncode == 7
    runs.touch()
    assert serve.cli("attach", b["job_id"]).returncode == 0
    log = serve.log.read_bytes()[seen:]
    assert log.count(GONE) == 1 and f"job-{b['job_id']}: ".encode() + GONE in log, log.decode()


def _empty_into_parent(group: Path) -> None:
    """Move every process of a v1 group into its parent, until none is left: the job's shell
    forks a `sleep` every 20 ms, which may exit before it is moved (ProcessLookupError, as
    in CI in stop 59) or be forked into the group after it was read (once the shell is
    moved its children are born in the parent)."""

    def moved() -> bool:
        pids = (group / "cgroup.procs").read_text().split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                (group.parent / "cgroup.procs").write_text(pid)
        return not pids
    wait_for(moved, what=f"the processes of {group} moved to its parent")


#: a job that leaves a process behind in its groups: out of its process group (a session of
#: its own), no marker in its environment (keeperd does not know it for the job's), its
#: output elsewhere; `Popen` returns once that process has exec'd, so keeperd finds the
#: groups busy at the job's end
LEAVES_A_PROCESS = ["python3", "-c", "import subprocess as s; s.Popen(['" + shutil.which("sleep")
                    + "', '60'], start_new_session=True, env={}, stdin=s.DEVNULL,"
                    " stdout=s.DEVNULL, stderr=s.DEVNULL)"]


#: a job that uses some CPU (its groups' counters are read before they go)
BUSY = "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"


def test_keeperd_removes_an_ended_jobs_empty_groups_before_its_terminal_record(
        serve_factory, private_parent, tmp_path):
    """Issue 14: a job that left nothing in its v1 groups has them read and removed by
    keeperd (their figures in its status, `isolation_released`, then the groups removed by
    its thread or, since stop 73, kept under a spare's name): its terminal record carries
    those figures, the job's groups go, and the runner has nothing to remove (it never
    reaches `release.begin`)."""

    reached = tmp_path / "release.reached"
    backend = open_cgroup_backend(parent=private_parent)
    if backend.version != 1:
        pytest.skip("keeperd makes (and removes) the groups on cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent)
    serve.env = {"MOTOR_FAULTS": f"release.begin=wait:{tmp_path / 'release'}"}
    serve.start()
    for _ in range(3):  # the first from a fresh keeperd, the next from its spares
        result = serve.cli("run", "--json", "--", "sh", "-c", BUSY)
        assert result.returncode == 0, result.stderr
        record = json.loads(result.stdout.decode().splitlines()[-1])["record"]
        status = json.loads((serve.state_dir / "jobs" / record["job_id"] / "status.json").read_text())
        assert record["state"] == "succeeded" and status["isolation_released"] is True
        assert record["reservation_use"]["cpu_time_ms"] == status["isolation_facts"]["cpu_time_ms"] > 0
        wait_for(lambda: _groups_gone(backend, record["job_id"]), what="its groups removed")
    assert backend.flavour.listed() == set()
    assert not reached.exists()


def test_a_jobs_groups_go_after_its_terminal_record_while_its_cpus_serve_the_next_job(
        serve_factory, private_parent, tmp_path):
    """Issue 14: removing a job's groups is off its end path. A job that left a process in
    its groups (keeperd leaves those to the runner) is settled (the process killed) and
    recorded; held at `release.begin`, its terminal record is out with its groups still
    there (nothing left in them), and its CPUs already serve the next job claiming every
    CPU; once the barrier opens both jobs' groups go. A runner killed at that point leaves
    the groups of a job it recorded as ended to the next start-up sweep."""

    barrier = tmp_path / "release"
    reached = tmp_path / "release.reached"
    backend = open_cgroup_backend(parent=private_parent)
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent)
    serve.env = {"MOTOR_FAULTS": f"release.begin=wait:{barrier}"}
    serve.start()
    claim = serve.cli_json("health")["capacity"]["claim_limit"]

    def run_all_cpus() -> dict:
        result = serve.cli("run", "--json", "--weight", str(claim), "--", *LEAVES_A_PROCESS)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.decode().splitlines()[-1])["record"]

    first = run_all_cpus()
    assert first["state"] == "succeeded"
    wait_for(reached.exists, what="the first job's release at the barrier")
    assert backend.adopt(first["job_id"])  # recorded as ended, its groups still there
    assert backend.flavour.pids(first["job_id"]) == []  # settled: nothing of it runs
    second = run_all_cpus()  # every CPU again: the first job's claim is free already
    assert second["state"] == "succeeded" and backend.adopt(first["job_id"])
    barrier.touch()
    wait_for(lambda: _groups_gone(backend, first["job_id"], second["job_id"]),
             what="both jobs' groups removed")

    serve.stop()
    serve.env = {"MOTOR_FAULTS": "release.begin=kill"}
    serve.start()
    third = serve.cli_json("submit", "--weight", "1", "--", *LEAVES_A_PROCESS)["job_id"]
    assert serve.proc.wait(30) == -9  # killed after the record, before the removal
    assert backend.adopt(third)
    serve.env = {}
    serve.start()
    assert b"start-up sweep: group job-" + third.encode() in serve.log.read_bytes()
    assert not backend.adopt(third)
    assert serve.cli("attach", third).returncode == 0  # its record: succeeded


def test_through_serve_a_lone_start_leaves_the_pool_short_and_a_burst_refills_it(
        serve_factory, private_parent):
    """Issue 14, through `motor serve --isolation cgroup` and the CLI: keeperd (started by
    the runner, with its environment; `MOTOR_KEEPERD_REFILL_IDLE_S` made 30 s so nothing
    refills by the clock) does not refill its spares after a lone job's start, so no
    migration stalls that job's exit; a second start within that time is a burst and the
    pool is full again at once (docs/isolation.md, "When the pool refills")."""
    from keeper_tracking import ask_keeperd

    if open_cgroup_backend(parent=private_parent).version != 1:
        pytest.skip("spares are for cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent)
    serve.env = {"MOTOR_KEEPERD_REFILL_IDLE_S": "30"}
    serve.start()
    full = ask_keeperd(serve.state_dir, "spares")["ready"]  # filled at the runner's start
    assert len(full) == DEFAULT_SIZE
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0  # the lone start
    after = ask_keeperd(serve.state_dir, "spares")
    assert (len(after["ready"]), after["joining"], after["taken"]) == (DEFAULT_SIZE - 1, [], 1)
    assert serve.cli("run", "--weight", "1", "--", "true").returncode == 0  # a burst
    refilled = wait_for(lambda: (lambda a: a["ready"] if len(a["ready"]) == DEFAULT_SIZE
                                 else None)(ask_keeperd(serve.state_dir, "spares")),
                        what="the pool full again")
    assert len(set(refilled) - set(full)) == 2


def test_a_restarted_runner_does_not_wait_for_a_refill_a_lone_start_put_off(
        serve_factory, private_parent, tmp_path):
    """Stop 64, through `motor serve --isolation cgroup`: a runner's start waits for
    keeperd's pool of spares (its "prepare"), but not for a refill the refill rule puts off.
    After a lone start (`MOTOR_KEEPERD_REFILL_IDLE_S` 30 s), a restarted runner is answered
    with the pool one short, logs no warning of a prepare it gave up on (with a full pool
    required, it waited out the 5 s and warned), and its next job comes from a spare.

    The lone job runs across the restart, so the same keeperd serves both runners: with
    no job it exits after IDLE_EXIT_S (2 s) without a runner, and on a loaded host the
    restart took longer; the new keeperd's pool, with no start yet, filled up (stop 81)."""
    from keeper_tracking import ask_keeperd

    if open_cgroup_backend(parent=private_parent).version != 1:
        pytest.skip("spares are for cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent)
    serve.env = {"MOTOR_KEEPERD_REFILL_IDLE_S": "30"}
    serve.start()
    barrier = tmp_path / "go"
    lone = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                          f"while [ ! -e {barrier} ]; do sleep 0.02; done")["job_id"]
    keeper = serve.state_dir / "jobs" / lone / "keeper.json"
    wait_for(lambda: keeper.exists() and json.loads(keeper.read_text()).get("job_pid"),
             what="the lone job to run")
    assert ask_keeperd(serve.state_dir, "spares")["taken"] == 1  # from a spare
    assert serve.stop() == 0
    serve.start()  # keeperd lives on; it let its spares go with the runner, and makes them again
    assert b"had not prepared" not in serve.log.read_bytes(), serve.log.read_text()
    pool = ask_keeperd(serve.state_dir, "spares")
    assert pool["taken"] == 1, pool  # the same keeperd (a new one's count starts at 0)
    assert (len(pool["ready"]), pool["joining"]) == (DEFAULT_SIZE - 1, []), pool
    assert serve.cli("run", "--weight", "1", "--workspace", "next", "--", "true").returncode == 0
    assert ask_keeperd(serve.state_dir, "spares")["taken"] == 2  # from a spare again
    barrier.touch()
    assert serve.cli("attach", lone).returncode == 0


def test_through_serve_ended_jobs_groups_serve_the_next_jobs_but_an_oom_killed_ones_do_not(
        serve_factory, private_parent):
    """Issue 14, stop 73, through `motor serve` and the CLI: keeperd keeps an ended job's
    empty v1 groups for its next spare (docs/isolation.md, "Spares (cgroup v1)", step 5),
    but not those of a job the OOM killer hit (v1's `oom_kill` count cannot be zeroed).
    After an OOM-killed job, jobs with the same claim and memory limit run from spares,
    some in an earlier job's groups: each in groups of its own name, with its own CPU time
    in its record, and none reported OOM-killed. Then jobs whose limits differ from those
    groups' (another memory limit, the claim's default), each from an ended job's groups,
    run under their own limits. No job group is left at the end. (A pool of one spare, so
    that the spare ready after a job's end is made of an ended job's groups.)"""
    from keeper_tracking import ask_keeperd

    backend = open_cgroup_backend(parent=private_parent)
    if backend.version != 1:
        pytest.skip("keeperd keeps groups for its spares on cgroup v1 hierarchies")
    serve = serve_factory("--isolation", "cgroup", "--cgroup-parent", private_parent)
    serve.env = {SIZE_ENV: "1"}
    serve.start()

    def run(*argv: str, memory: int | None = 64 << 20) -> tuple[dict, list[str]]:
        limit = () if memory is None else ("--memory-max", str(memory))
        result = serve.cli("run", "--json", "--weight", "1", *limit, "--", *argv)
        events = [json.loads(line) for line in result.stdout.decode().splitlines()]
        return events[-1]["record"], "".join(
            e["data"] for e in events if e["event"] == "output").splitlines()

    hog, _ = run("python3", "-c", "b = b'x' * (512 << 20); print(len(b))")
    assert hog["reason"] == "oom_killed", hog
    reused = ask_keeperd(serve.state_dir, "spares")["reused"]
    for _ in range(4):
        record, out = run("sh", "-c", BUSY + "; cat /proc/self/cgroup")
        assert record["state"] == "succeeded" and record["reason"] is None, record
        groups = {name: path for line in out for _, names, path in [line.split(":", 2)]
                  for name in names.split(",")}
        want = f"/{private_parent}/job-{record['job_id']}"
        assert [groups[c] for c in ("cpuset", "memory", "cpuacct")] == [want] * 3
        status = json.loads(
            (serve.state_dir / "jobs" / record["job_id"] / "status.json").read_text())
        facts = status["isolation_facts"]
        assert facts["oom_killed"] is False and facts["oom_kills"] == 0, facts
        assert record["reservation_use"]["cpu_time_ms"] == facts["cpu_time_ms"] > 0
    wait_for(lambda: ask_keeperd(serve.state_dir, "spares")["reused"] > reused,
             what="an ended job's groups made a spare's")
    own_limit = ('p=$(grep memory /proc/self/cgroup | cut -d: -f3); '
                 'cat "/sys/fs/cgroup/memory$p/memory.limit_in_bytes"')

    def ready() -> dict:  # the pool once its one spare is ready
        wait_for(lambda: ask_keeperd(serve.state_dir, "spares")["ready"], what="a spare")
        return ask_keeperd(serve.state_dir, "spares")

    # The pool holds one spare, refilled once each job takes it: the spare ready after a
    # job is an ended job's groups when `reused` grew over that job. Not every ended job's
    # are kept (those whose memory group still holds over RECYCLE_MAX_USAGE, kernel memory
    # the exited processes have not handed back yet, are removed: 0.3-0.7 MiB here when
    # idle, more under load), so each limit is run until its job took such a spare.
    prev = ready()
    run("true")
    cur = ready()
    for memory in (96 << 20, None):  # None: the claim's default
        for _ in range(5):
            from_ended = cur["reused"] > prev["reused"]  # the spare this job takes
            record, out = run("sh", "-c", own_limit, memory=memory)
            assert record["state"] == "succeeded", record
            assert int(out[-1]) == record["memory_max_bytes"] != 64 << 20, (out, record)
            assert memory is None or record["memory_max_bytes"] == memory, record
            prev, cur = cur, ready()
            assert [cur[k] - prev[k] for k in ("taken", "missed")] == [1, 0], cur
            if from_ended:
                break
        else:
            pytest.fail(f"no job with memory {memory} started in an ended job's groups: {cur}")
    wait_for(lambda: backend.flavour.listed() == set(), what="no job group left")
