"""The job execution actor's rules (motor/execution/core.py), pure: no trio, no process, no
file. The actor that carries them out is tested in test_execution_actor.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from motor.execution import core
from motor.lifecycle import LifecycleError
from motor.records import JobRecord, Refusal

JOB_ID = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"


def record(**kw) -> JobRecord:
    fields = dict(job_id=JOB_ID, state="setup", workspace="ws", claim=2, cpus=[2, 3],
                  command=["make", "-j2"], accepted_at_ms=1_000)
    return JobRecord(**{**fields, **kw})


def test_the_core_imports_no_trio():
    code = ("import sys, motor.execution.core; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('trio', 'actors')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the job's environment and spec ------------------------------------------------------------

names = st.text(st.characters(min_codepoint=65, max_codepoint=90) | st.just("_"),
                min_size=1, max_size=12)
envs = st.dictionaries(names | st.sampled_from(["MOTOR_JOB_ID", "MOTOR_CPUS", "MOTOR_VCPUS",
                                                "MOTOR_WORKSPACE", "MOTOR_COMPILE_CACHE"]),
                       st.text(max_size=8), max_size=6)


@given(base=envs, requested=envs, cache=st.none() | st.just("/cache"))
def test_the_runner_s_variables_win_over_the_request_which_wins_over_the_runner_env(
        base, requested, cache):
    env = core.job_env(record(env=requested), base, cache)
    mine = {"MOTOR_JOB_ID": JOB_ID, "MOTOR_WORKSPACE": "ws", "MOTOR_VCPUS": "2",
            "MOTOR_CPUS": "2,3"} | ({"MOTOR_COMPILE_CACHE": cache} if cache else {})
    for name, value in mine.items():
        assert env[name] == value  # the job marker and its CPUs cannot be overridden
    for name in set(base) | set(requested):
        if name not in mine:
            assert env[name] == requested.get(name, base.get(name))
    assert set(env) == set(base) | set(requested) | set(mine)


def test_no_cpus_means_no_motor_cpus_and_the_base_env_is_not_touched():
    base = {"MOTOR_CPUS": "9", "PATH": "/bin"}
    env = core.job_env(record(cpus=None), base)
    assert env["MOTOR_CPUS"] == "9" and base == {"MOTOR_CPUS": "9", "PATH": "/bin"}
    assert "MOTOR_COMPILE_CACHE" not in env


def test_the_spec_carries_the_command_and_the_isolation_fields_come_last():
    r = record(timeout_s=30.0)
    spec = core.job_spec(r, "/w/ws", {"A": "1"}, 0o022,
                         {"cgroup_procs": ["/sys/fs/cgroup/x/cgroup.procs"], "cpus": [3]})
    assert spec == {"job_id": JOB_ID, "command": ["make", "-j2"], "cwd": "/w/ws",
                    "env": {"A": "1"}, "cpus": [3], "timeout_s": 30.0,
                    "kill_grace_s": core.KILL_GRACE_S, "umask": 0o022,
                    "cgroup_procs": ["/sys/fs/cgroup/x/cgroup.procs"]}


# --- what the job directory says (docs/keeper.md, "Start protocol") -------------------------------

CLAIM = {"keeper_pid": 42, "keeper_create_time": 7.5, "started_at_ms": 1234}


@pytest.mark.parametrize("keeper, status, exists, expected", [
    (None, False, False, core.Found(adopt=False)),  # never set up
    (None, False, True, core.Found(adopt=False, kill_strays=True)),  # a start cut short
    (CLAIM, False, True, core.Found(adopt=True, keeper=(42, 7.5), started_at_ms=1234)),
    (CLAIM, True, True, core.Found(adopt=True, keeper=(42, 7.5), started_at_ms=1234)),
    (None, True, True, core.Found(adopt=True)),  # only the exit status is left
    ({"keeper_pid": 42, "keeper_create_time": 7.5}, False, True,
     core.Found(adopt=True, keeper=(42, 7.5))),  # the keeper has not said when the job began
])
def test_what_the_job_directory_says(keeper, status, exists, expected):
    assert core.found(keeper, status, exists) == expected


def test_a_spawn_refused_as_claimed_whose_claim_is_missing_stops_the_job():
    """keeperd refused the spawn as claimed (it keeps the job), yet the directory holds no
    claim: it was removed while the job ran, and the setup made it again. The job is
    adopted with no keeper, its processes stopped, and the detail says why (before stop 60
    it was adopted as an empty claim: `lost`, "exited without recording an exit status")."""
    gone = core.claimed_found(None)
    assert (gone.adopt, gone.kill_strays, gone.keeper) == (True, True, None)
    assert "removed while the job ran" in gone.claim_error
    assert core.claimed_found({}) == core.Found(adopt=True)  # an empty claim: its status is left
    assert core.claimed_found(CLAIM).keeper == (42, 7.5)
    damaged = core.claimed_found(None, "keeper.json: corrupt JSON")
    assert damaged.kill_strays and damaged.claim_error == "keeper.json: corrupt JSON"


def test_a_job_recorded_running_whose_claim_is_missing_is_never_spawned_again():
    """No claim, no status: a start cut short is set up again, but a job recorded running
    was spawned; its claim lost after that (stop 49), it is adopted with no keeper, its
    processes stopped first, as a claim that names none."""
    lost = core.found(None, False, True, ran=True)
    assert (lost.adopt, lost.kill_strays, lost.keeper) == (True, True, None)
    assert "recorded running" in lost.claim_error
    assert core.found(None, True, True, ran=True) == core.Found(adopt=True)  # its status is left
    assert core.found(CLAIM, False, True, ran=True).keeper == (42, 7.5)


ERRORS = ["claimed", "not_started", "spawner", "other"]


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("claim", [False, True])
@pytest.mark.parametrize("cancel", [False, True])
def test_a_claim_on_disk_is_adopted_and_never_spawned_again(error, claim, cancel):
    outcome = core.after_start_error(error, claim, cancel)
    if error == "claimed" or (error == "spawner" and claim):
        assert outcome == core.ADOPT  # a keeper may run the job (a cancel then signals it)
    elif error == "not_started":
        assert outcome == core.SPAWN_FAILED
    else:  # nothing ran: requeued, unless cancelled meanwhile
        assert outcome == (core.CANCELLED if cancel else core.REQUEUE)


def test_a_keeper_that_never_started_leaves_a_spawn_failed_status():
    status = core.spawn_failed_status("exec failed")
    ended = core.terminal_record(record(), status, 5_000, {})
    assert (ended.state, ended.reason, ended.detail) == ("failed", "spawn_failed", "exec failed")


# --- cancel in each phase -----------------------------------------------------------------------

#: The actor's path: setup checkpoints, then the spawn, then following the keeper.
STEPS = ["checkpoint", "checkpoint", "spawning", "spawned", "following"]


@settings(max_examples=50)
@given(cancel_at=st.integers(0, len(STEPS)), second=st.booleans())
def test_a_cancel_is_carried_out_in_whichever_phase_it_arrives(cancel_at, second):
    """Before the keeper exists a cancel is remembered and ends setup at the next checkpoint,
    or signals the keeper as soon as it is known; afterwards it signals the keeper at once.
    Either way exactly one of those happens (a second cancel changes nothing of that)."""
    run = core.JobRun(record())
    stopped_in_setup = signalled = False
    for i, step in enumerate(STEPS + ["end"]):
        if i == cancel_at:
            for _ in range(2 if second else 1):
                action = run.cancel()
                assert action == (core.SIGNAL if run.keeper else core.DEFER)
                signalled |= action == core.SIGNAL
        if step == "checkpoint" and run.setup_cancelled():
            stopped_in_setup = True
            break
        if step == "spawning":
            run.spawning()
            assert not run.setup_cancelled()  # no checkpoint once the spawn is asked for
        if step == "spawned":
            run.follow((42, 7.5))
            signalled |= run.cancel_due()
    assert stopped_in_setup == (cancel_at < 2)
    assert signalled == (cancel_at >= 2)


def test_a_cancel_while_following_a_job_whose_keeper_already_exited_is_ignored():
    run = core.JobRun(record())
    run.follow(None)  # adopted: only status.json was left
    assert run.cancel() == core.IGNORE and not run.cancel_due()


def test_ending_in_setup_cancelled_or_refused():
    cancelled = core.ended_in_setup(record(), None, 9_000, "job-x")
    assert (cancelled.state, cancelled.reason, cancelled.detail, cancelled.ended_at_ms) == (
        "cancelled", "cancelled", "cancelled during setup", 9_000)
    assert cancelled.started_at_ms is None
    refused = core.ended_in_setup(
        record(), Refusal(code="runner_disk_full", detail="12 bytes free"), 9_000)
    assert (refused.state, refused.reason, refused.detail) == (
        "refused_before_start", "runner_disk_full", "12 bytes free")
    with pytest.raises(LifecycleError, match="'refuse' in job state 'running'.*job-x"):
        core.ended_in_setup(record(state="running"), Refusal(code="x", detail="y"), 9_000,
                            "job-x")  # a running job is past its setup check


def test_running_since_the_keeper_s_start_or_now():
    assert core.running_record(record(), 1_500, 9_000).started_at_ms == 1_500
    assert core.running_record(record(), None, 9_000).started_at_ms == 9_000
    assert core.running_record(record(), None, 9_000).state == "running"


# --- output -------------------------------------------------------------------------------------

chunks = st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]),
                            st.text(max_size=20), st.integers(0, 4)), max_size=12)


@given(chunks=chunks, cuts=st.lists(st.integers(0, 80), max_size=6))
def test_output_text_survives_any_split_into_records(chunks, cuts):
    """Whatever record boundaries the keeper's pipe reads fall on (inside a multi-byte
    character too), each stream's events join to exactly what the job wrote."""
    wrote = {"stdout": "", "stderr": ""}
    records = []
    for stream, text, cut in chunks:
        wrote[stream] += text
        data = text.encode()
        at = min(cut, len(data))
        records += [(stream, data[:at]), (stream, data[at:])]
    decoder, events = core.OutputDecoder(), []
    bounds = sorted({0, len(records), *(min(c, len(records)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):  # batches
        events += decoder.events(records[a:b])
    assert all(e.data for e in events)  # no empty output events
    for stream in wrote:
        assert "".join(e.data for e in events if e.stream == stream) == wrote[stream]


def test_invalid_bytes_become_replacement_characters_and_travel_exact_beside_them():
    events = core.OutputDecoder().events([("stdout", b"ok \xff\xfe!")])
    assert [e.data for e in events] == ["ok \ufffd\ufffd!"]
    assert [e.raw() for e in events] == [b"ok \xff\xfe!"]  # data_b64 (stop 58)
    valid = core.OutputDecoder().events([("stdout", "a \ufffd the job wrote".encode())])
    assert valid[0].data_b64 is None  # a U+FFFD that was in the bytes: text alone


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.binary(max_size=12)),
                max_size=12),
       st.lists(st.integers(min_value=0, max_value=24), max_size=4))
def test_whatever_bytes_a_job_writes_each_streams_events_and_tail_give_them_back(records, cuts):
    """Stop 58: the bytes, valid UTF-8 or not and cut anywhere (between batches too), come
    back exactly from each stream's events (`Output.raw`), with what the end held (`tail`:
    before, the first bytes of a character the output's end cut short were dropped); and
    `data` is what a UTF-8 decoder with U+FFFD makes of them."""
    decoder, events = core.OutputDecoder(), []
    bounds = sorted({0, len(records), *(min(c, len(records)) for c in cuts)})
    for a, b in zip(bounds, bounds[1:]):
        events += decoder.events(records[a:b])
    events += decoder.tail()
    assert decoder.tail() == []
    for stream in ("stdout", "stderr"):
        wrote = b"".join(data for s, data in records if s == stream)
        mine = [e for e in events if e.stream == stream]
        assert b"".join(e.raw() for e in mine) == wrote
        assert "".join(e.data for e in mine) == wrote.decode("utf-8", "replace")
        assert all(e.data_b64 is None for e in mine) or not _valid(wrote)


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_log_that_cannot_be_read_stops_output_and_says_where():
    decoder = core.OutputDecoder()
    assert decoder.error is None
    text = decoder.stopped(4096, ValueError("bad record stream byte 7"))
    assert decoder.error == text == (
        "output stopped at byte 4096 of output.log: bad record stream byte 7")


# --- the end ------------------------------------------------------------------------------------

STATUS = {"exit_code": 0, "signal": None, "reason": None, "detail": None,
          "started_at_ms": 1_000, "ended_at_ms": 61_000, "wall_time_ms": 60_000,
          "cpu_time_ms": 30_000}


def test_the_group_s_cpu_time_replaces_the_keeper_s_figure():
    running = record(state="running", started_at_ms=1_000)
    ended = core.terminal_record(running, dict(STATUS), 70_000, {"cpu_time_ms": 90_000})
    assert ended.state == "succeeded" and ended.ended_at_ms == 61_000
    assert ended.reservation_use.cpu_time_ms == 90_000  # the whole tree, not the keeper's
    kept = core.terminal_record(running, dict(STATUS), 70_000, {"cpu_time_ms": None})
    assert kept.reservation_use.cpu_time_ms == 30_000


def test_a_lost_keeper_and_stopped_output_are_both_in_the_detail():
    running = record(state="running", started_at_ms=1_000)
    ended = core.terminal_record(running, None, 70_000, {}, "output stopped at byte 9")
    assert (ended.state, ended.reason, ended.ended_at_ms) == ("lost", "keeper_lost", 70_000)
    assert ended.detail == ("the job's keeper exited without recording an exit status; "
                            "output stopped at byte 9")
    # a status.json the keeper left that cannot be read: lost all the same, and said so
    damaged = core.terminal_record(running, None, 70_000, {}, None,
                                   "/s/jobs/j/status.json: corrupt JSON: Expecting value")
    assert (damaged.state, damaged.reason) == ("lost", "keeper_lost")
    assert damaged.detail == ("the job's exit status cannot be read: "
                              "/s/jobs/j/status.json: corrupt JSON: Expecting value")


def test_isolation_problems_are_listed_not_fatal():
    assert core.isolation_problems({"collect_error": "EIO", "cleanup_error": None,
                                    "oom_killed": False}) == [("collect_error", "EIO")]
