"""The bench scripts that wrap the runner's own functions still run against this code.

A few scripts in bench/ time or count the runner from inside: their round (run in a fresh
interpreter by `benchlib.run_round`) replaces a function of the runner with a wrapper that
notes when it is called and calls the original. When that function's signature changes, the
wrapper breaks the runner it measures, and nothing else notices (bench/slot_cycle.py's
wrapper of `JobExecution._finish` did, for a day). Each script's round runs here once, on
a few jobs, and must give its figures. Nothing is timed: what the figures are is the
scripts' business (docs/performance.md), that they come is this test's.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench(name: str):
    """bench/NAME.py as a module (`bench_NAME`), with bench/ on sys.path only while it is
    imported (the scripts import `benchlib`; their names, e.g. `isolation`, stay out of
    the suite's way)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _round(module, *args: str) -> dict:
    try:
        return _bench("benchlib").run_round(module.ROUND, BENCH.parent, "affinity", *args)
    except SystemExit as exc:  # run_round's way of saying the round failed
        pytest.fail(f"{module.__file__}'s round failed: {exc}")


def test_slot_cycle_splits_every_jobs_cycle_into_its_steps():
    slot_cycle = _bench("slot_cycle")
    got = _round(slot_cycle, "6")
    assert set(got["steps"]) == set(slot_cycle.STEPS)
    # every job was seen from its spawn request to its actor's end
    counts = {step: count for step, (_, _, count) in got["steps"].items()}
    assert counts["keeperd_spawn"] == counts["actor_wake"] == 6
    assert got["wall_s"] > 0 and got["cpu_s"] > 0


def test_start_path_times_each_sample_from_submit_to_spawn_run_and_end():
    start_path = _bench("start_path")
    got = _round(start_path, "4", "0.01")
    for metric in start_path.METRICS:
        assert len(got[metric]) == 2, metric  # 4 samples, the first two are warm-up
    for spawn, to_keeperd, to_job, run, end in zip(*(got[m] for m in start_path.METRICS)):
        assert 0 < spawn < run < end
        assert 0 < to_keeperd and 0 < to_job  # keeperd's clock is this one (CLOCK_MONOTONIC)
        assert spawn + to_keeperd + to_job == pytest.approx(run, abs=1e-6)


def test_start_path_runs_the_command_it_is_given():
    """`start_path.py --command`: the round's jobs are that command (here one that sleeps
    50 ms before its timestamp, so the keeper side of each start takes that long at least)."""
    start_path = _bench("start_path")
    got = _round(start_path, "3", "0.01", json.dumps(["sh", "-c", "sleep 0.05; date +%s.%N"]))
    assert len(got["keeperd_to_job"]) == 1
    assert got["keeperd_to_job"][0] >= 50 and got["start_to_spawn"][0] < 50


def test_job_cost_gives_the_runners_keeperds_and_the_hosts_cpu():
    """`job_cost.py`'s round: the runner's own CPU, its keeperd's and the whole host's over
    the burst, each above zero, the host's the largest. The readings are in clock ticks
    (10 ms) and keeperd spends about 0.5 ms a job under affinity, so the burst is long
    enough for several ticks of keeperd's (20 jobs read 0 once in CI)."""
    job_cost = _bench("job_cost")
    got = job_cost.one_round(BENCH.parent, "affinity", 150, ["true"])
    assert got["bad"] == [] and got["wall_s"] > 0
    assert 0 < got["cpu_s"] <= got["host_s"] and 0 < got["keeperd_s"] <= got["host_s"]


def test_messages_counts_the_messages_of_each_job():
    got = _round(_bench("messages"), "6")
    assert got, "no message counted"
    kinds = {key.split("|")[0] for key in got}
    assert "dispatcher" in kinds, kinds


def test_loop_stalls_reads_the_loops_steps():
    loop_stalls = _bench("loop_stalls")
    got = _round(loop_stalls, "6")
    assert set(loop_stalls.METRICS) <= set(got)


def test_the_rows_script_runs_scripts_that_take_its_flags():
    """bench/rows.sh runs every row of issue 14's table; `--check` asks each script it names
    for its `--help` and finds each flag the row passes (a renamed flag fails here, not in
    the middle of a 10-minute run)."""
    done = subprocess.run(["bash", str(BENCH / "rows.sh"), "--check"], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ok: ") == 9, done.stdout
    assert "scale.py" in done.stdout and "--backend-pairs" in done.stdout
    assert "ok: latency.py --rounds 3 --samples 20 --isolation cgroup" in done.stdout


def test_cold_start_times_each_piece_of_work_at_each_gap(tmp_path):
    """bench/cold_start.py (docs/performance-history.md, "Stop 66") prints one line per piece of
    work and gap, each with its ratio to the first gap's median."""
    done = subprocess.run([sys.executable, str(BENCH / "cold_start.py"), "--samples", "3",
                           "--gaps", "0,0.001", "--dir", str(tmp_path)], cwd=BENCH,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("peer=host")]
    assert [(f[1], f[4]) for f in lines] == [
        (f"metric={name}", f"gap_s={gap}") for name in ("sqlite_commit", "python_calls",
                                                       "fork_exec") for gap in ("0", "0.001")]
    assert all(f[5] == "cold_x=1.00" for f in lines[::2])  # the first gap is the reference


def test_host_busy_counts_the_cpu_a_process_spends(monkeypatch):
    """benchlib.host_busy_s (bench/throughput.py's host CPU per job) grows by the CPU this
    process burns between two readings, and counts every /proc/stat field but idle and
    iowait, guest time only once (the kernel counts it in user and nice too). Idle time is
    read from a given /proc/stat line, not from a sleep on this host: under the suite's two
    workers the other one can keep every CPU busy through the sleep."""
    benchlib = _bench("benchlib")
    before, cpu0 = benchlib.host_busy_s(), time.process_time()
    while time.process_time() - cpu0 < 0.3:
        pass
    assert benchlib.host_busy_s() - before >= 0.25  # 10 ms ticks round it down; others add
    tick = os.sysconf("SC_CLK_TCK")
    # user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice
    line = "cpu  " + " ".join(str(n * tick) for n in (3, 1, 2, 50, 7, 1, 1, 1, 1, 1)) + "\n"
    monkeypatch.setattr(benchlib, "open", lambda path: io.StringIO(line + "cpu0 1 2 3\n"),
                        raising=False)
    assert benchlib.host_busy_s() == 9.0


def test_process_cpu_counts_one_process_only():
    """benchlib.process_cpu_s (bench/throughput.py's runner and keeperd CPU per job,
    bench/floor.py's server CPU) grows by the CPU that process burns, and not by another
    process's."""
    benchlib = _bench("benchlib")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)  # its start-up spent
        mine, its, cpu0 = (benchlib.process_cpu_s(os.getpid()),
                           benchlib.process_cpu_s(sleeper.pid), time.process_time())
        while time.process_time() - cpu0 < 0.3:
            pass
        assert benchlib.process_cpu_s(os.getpid()) - mine >= 0.25
        assert benchlib.process_cpu_s(sleeper.pid) - its < 0.05
    finally:
        sleeper.kill()
        sleeper.wait()


def test_throughput_counts_the_runners_and_keeperds_own_cpu(monkeypatch, short_dir):
    """bench/throughput.py's round finds the runner's process and its keeperd and gives
    each one's CPU over the burst (`runner_cpu_per_job_ms`, `keeperd_cpu_per_job_ms`). In
    clock ticks (10 ms): 100 jobs of keeperd's about 0.5 ms each are several."""
    monkeypatch.setenv("TMPDIR", str(short_dir))
    throughput, own = _bench("throughput"), {}
    wall, submitted, busy = throughput.motor_round(100, "affinity", own=own)
    assert wall >= submitted > 0 and busy > 0
    assert set(own) == {"runner", "keeperd", "runner_wait", "keeperd_wait", "client"}
    assert 0 < own["runner"] <= busy and 0 < own["keeperd"] <= busy
    assert own["runner_wait"] >= 0 and own["keeperd_wait"] >= 0 and own["client"] > 0


BURNER = """
import sys, threading, time

def burn(seconds):  # on the thread's own clock
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass

print("ready", flush=True)
sys.stdin.readline()
burnt = threading.Event()
worker = threading.Thread(target=lambda: (burn(0.2), burnt.set(), time.sleep(60)), daemon=True)
worker.start()
burn(0.3)
burnt.wait()
print("burnt", flush=True)  # the worker still alive: counted
sys.stdin.readline()
"""


def test_sched_counts_one_process_on_a_cpu_and_not_a_sleeper():
    """benchlib.sched_s (bench/throughput.py's `runner_wait_per_job_ms`) gives a process's
    time on a CPU in nanoseconds, summed over its threads: it grows by what a process's two
    threads burn (0.3 s and 0.2 s), and a sleeping process's does not."""
    benchlib = _bench("benchlib")
    # the sleeper's figures are read once it sleeps: read while its interpreter still
    # started, on a loaded host they grew (stop 81: its wait by 93 ms)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); "
                                "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    burner = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert burner.stdout.readline() == "ready\n" and sleeper.stdout.readline() == "ready\n"
        (before, _), (its, its_wait) = benchlib.sched_s(burner.pid), benchlib.sched_s(sleeper.pid)
        burner.stdin.write("go\n")
        burner.stdin.flush()
        assert burner.stdout.readline() == "burnt\n"
        on, wait = benchlib.sched_s(burner.pid)
        assert 0.45 <= on - before < 5 and wait >= 0
        on, wait = benchlib.sched_s(sleeper.pid)
        assert on - its < 0.05 and wait - its_wait < 0.05
    finally:
        for proc in (sleeper, burner):
            proc.kill()
            proc.wait()
        burner.stdin.close()
        burner.stdout.close()
        sleeper.stdout.close()


def test_throughput_budget_is_what_task_spoolers_rate_leaves_the_runner(capsys):
    """bench/throughput.py's budget line: at task-spooler's rate two CPUs give 2 / rate of
    host CPU per job, and what motor's other processes took (the host's less the runner's)
    is not the runner's."""
    throughput = _bench("throughput")
    throughput.budget(0.25, 200, {"motor": (0.8, 0.4, 0.1)})  # 800 jobs/s; per job: 4, 2, 0.5 ms
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("# budget at task-spooler's 800.0 jobs/s: 2.50 ms of host CPU per job on two"
                      " CPUs, 1.25 ms of the runner's thread")
    assert out[1] == ("# motor       others (the client, keeperd, the jobs) 2.00 ms/job leave the"
                      " runner 0.50; it ran 2.00 and waited 0.50 for a CPU")


def test_the_floor_runs_motors_rules_and_keeperd_against_this_code(monkeypatch, short_dir):
    """bench/floor.py's `*-rules-*` variants call motor's own request decoder, record,
    scheduler core, CPU placement and spec.json writer in their server, and `-keeperd`
    speaks keeperd's protocol to a real keeperd (`-end-`: and reads each end's status.json
    and output.log with motor's readers; docs/performance.md, "A runner with motor's rules
    and none of its structure"); each variant starts its jobs (the timestamp of `date`
    comes) and runs a burst to its end. The `actors` variants lay the same rules out as
    motor's architecture does (a supervised actor of motor's runtime per subsystem, one per
    job, "A runner with motor's rules in motor's shape"): a burst ends only once each job's
    actor has recorded its end."""
    monkeypatch.setenv("TMPDIR", str(short_dir))
    floor = _bench("floor")
    for variant in ("http-rules-keeper", "h11-rules-keeper", "http-rules-keeperd",
                    "http-rules-end-keeperd", "http-actors-end-keeperd",
                    "http-actors-now-end-keeperd", "h11-actors-now-end-keeperd",
                    "http-actors-now-accept-end-keeperd", "h11-actors-now-accept-end-keeperd"):
        lats = floor.one(variant, 3, 0.01)
        assert len(lats) == 3 and all(lat > 0 for lat in lats), (variant, lats)
        assert floor.one(variant, 0, 0, 8) > 0, variant


def test_the_floors_keeperd_waits_for_a_server_slow_to_start(monkeypatch, short_dir):
    """keeperd leaves after IDLE_EXIT_S with no connection; the floor holds one from its
    start, as a runner does, so a server that takes longer than that to start (as under the
    suite's two workers: stop 76's and stop 79's server that exited, not finding keeperd's
    socket) still finds it."""
    from motor.execution.keeperd import IDLE_EXIT_S

    monkeypatch.setenv("TMPDIR", str(short_dir))
    floor, popen = _bench("floor"), subprocess.Popen

    def slow_server(args, *rest, **kwargs):
        if args[:3] == [sys.executable, "-c", floor.SERVER]:
            time.sleep(IDLE_EXIT_S + 0.5)  # a host too loaded to start it sooner
        return popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", slow_server)
    lats = floor.one("http-rules-keeperd", 1, 0.01)
    assert len(lats) == 1 and lats[0] > 0


def test_the_floors_call_counts_come_from_its_servers(short_dir):
    """`bench/floor.py --burst N --calls` prints each burst variant's Python calls per job
    in its server (docs/performance-history.md, "Stop 70"); motor's rules add calls to the
    request they ride on, whichever HTTP layer serves it; laid out in actors they take more,
    and fewer where the actors answer in the sender's task (`immediate`)."""
    done = subprocess.run([sys.executable, str(BENCH / "floor.py"), "--burst", "8", "--calls"],
                          cwd=BENCH, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(short_dir)})
    assert done.returncode == 0, done.stderr
    got = {}
    for line in done.stdout.splitlines():
        if line.startswith("peer="):
            fields = dict(field.split("=", 1) for field in line.split())
            assert fields["metric"] == "python_calls_per_job", line
            got[fields["peer"]] = float(fields["value"])
    assert set(got) == {f"floor-{v}" for v in _bench("floor").BURST_VARIANTS}
    assert got["floor-http-rules-keeper"] > got["floor-http-commit-keeper"] > 0
    assert got["floor-h11-rules-keeper"] > got["floor-h11-keeper"] > 0
    assert (got["floor-http-actors-end-keeperd"] > got["floor-http-actors-now-end-keeperd"]
            > got["floor-http-rules-end-keeperd"])


def test_the_floor_runs_only_the_variants_asked_for(short_dir):
    """`--only` runs the named variants and no others; a name that is no variant is refused."""
    run = functools.partial(subprocess.run, cwd=BENCH, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TMPDIR": str(short_dir)})
    done = run([sys.executable, str(BENCH / "floor.py"), "--burst", "4", "--calls",
                "--only", "h11-keeper,http-rules-keeperd"])
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith("peer=")
            ] == ["peer=floor-h11-keeper", "peer=floor-http-rules-keeperd"]
    refused = run([sys.executable, str(BENCH / "floor.py"), "--only", "h11-keeper,nothing"])
    assert refused.returncode == 2 and "no such variant: nothing" in refused.stderr


def test_the_floor_counts_its_servers_own_cpu(monkeypatch, short_dir):
    """A burst round gives its server's own CPU over the burst (`server_cpu_per_job_ms`)."""
    monkeypatch.setenv("TMPDIR", str(short_dir))
    cpu: list[float] = []
    assert _bench("floor").one("http-keeper", 0, 0, 100, cpu=cpu) > 0
    assert len(cpu) == 1 and cpu[0] > 0


def test_http_layer_bursts_serve_motor_under_both_servers(short_dir):
    """`bench/http_layer.py --burst N` runs N jobs through `motor serve` as shipped and with
    its h11 probe in place of hypercorn's connection handler, and gives each runner's own
    CPU per job (docs/performance-history.md, "Stop 71")."""
    done = subprocess.run([sys.executable, str(BENCH / "http_layer.py"), "--rounds", "1",
                           "--burst", "30", "--no-peers"], cwd=BENCH, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(short_dir)})
    assert done.returncode == 0, done.stderr
    got = {}
    for line in done.stdout.splitlines():
        if line.startswith("peer="):
            fields = dict(field.split("=", 1) for field in line.split())
            got[fields["server"]] = (float(fields["value"]), float(fields["runner_cpu_per_job_ms"]))
    assert set(got) == {"hypercorn", "h11"}
    assert all(rate > 0 and cpu > 0 for rate, cpu in got.values()), got
