"""The `motor` CLI: parsing, exit statuses, and the client commands against a served fake runner."""

from __future__ import annotations

import json
import sys
import types

import pytest
import trio
from fake_runner import exits, queue_then_withdraw, wait_for_cancel

import motor
from motor.cli import build_parser, exit_status, main
from motor.cli import commands
from motor.client import RunnerUnavailable
from motor.config import ConfigError
from motor.records import JobRecord, Refusal, RefusedError


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("motor: error: ")
    return lines[0]


async def cli(*argv: str) -> int:
    return await trio.to_thread.run_sync(main, list(argv))


# --- exit statuses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome, status",
    [
        ({"state": "succeeded", "exit_code": 0}, 0),
        ({"state": "failed", "exit_code": 3}, 3),
        ({"state": "failed", "exit_code": None, "signal": 9, "reason": "oom_killed"}, 137),
        ({"state": "failed", "exit_code": None, "signal": 15}, 143),
        ({"state": "failed", "exit_code": None}, 1),
        ({"state": "timed_out", "signal": 9}, 124),
        ({"state": "cancelled"}, 130),
        ({"state": "refused_before_start", "reason": "queue_wait_exceeded"}, 75),
        ({"state": "lost"}, 70),
        (JobRecord(job_id="j", state="failed", workspace="w", exit_code=2), 2),
        (Refusal(code="runner_full", detail="full"), 75),
        (Refusal(code="runner_disk_full", detail="disk"), 75),
        (Refusal(code="workspace_setup_failed", detail="clone"), 75),
        (Refusal(code="queue_wait_exceeded", detail="late"), 75),
        (Refusal(code="bad_request", detail="bad"), 65),
        (Refusal(code="history_expired", detail="old"), 1),
        (Refusal(code="not_found", detail="who"), 1),
        ({"refused": True, "code": "runner_full", "detail": "x"}, 75),
        (RefusedError(Refusal(code="bad_request", detail="x")), 65),
        (RunnerUnavailable("no"), 69),
    ],
)
def test_exit_status_table(outcome, status):
    assert exit_status(outcome) == status


def test_exit_status_refuses_a_running_record():
    with pytest.raises(ValueError):
        exit_status({"state": "running"})


# --- parsing --------------------------------------------------------------------------------


def test_serve_bad_int_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--max-weight", "x"])
    assert info.value.code == 2
    assert "--max-weight" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--linux-cpus", "0-3", "--max-weight", "0"], "--linux-cpus"),
        (["serve", "--config", "/nonexistent/motor.toml"], "cannot read config"),
        (["serve", "--listen", "0.0.0.0:8080"], "--token-file"),
        (["serve", "--listen", "[::]:8080"], "--token-file"),
        (["serve", "--listen", "build-host:7700"], "--token-file"),
        (["serve", "--body-timeout", "0"], "--body-timeout"),
        (["serve", "--max-connections", "0"], "--max-connections"),
        (["serve", "--free-space-floor-bytes", "lots"], "not a size"),
        (["serve", "--windows-cpus", "0-3"], "--windows-slot-lock"),
        # a socket path past the kernel's 107 bytes: before stop 57 the API actor crashed
        # at each restart, then serve exited 3 (which a service manager restarts for ever)
        (["serve", "--state-dir", "/tmp/" + "x" * 120], "a Unix socket's path holds at most 107"),
        (["serve", "--socket", "/run/" + "s" * 110 + ".sock"], "give --socket a shorter path"),
    ],
)
def test_serve_config_errors_are_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


def test_serve_config_file_with_unknown_key(tmp_path, capsys):
    cfg = tmp_path / "motor.toml"
    cfg.write_text('max-weight = 4\nmax_wieght = 5\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "max_wieght" in one_error_line(capsys)


@pytest.fixture
def fake_serve_forever(monkeypatch):
    calls = []
    module = types.ModuleType("motor.runner")

    async def serve_forever(config):
        calls.append(config)
        if config.isolation == "systemd":
            raise ConfigError("systemd is not available here")

    module.serve_forever = serve_forever
    monkeypatch.setitem(sys.modules, "motor.runner", module)
    monkeypatch.setattr(motor, "runner", module, raising=False)
    return calls


def test_serve_builds_config_file_then_flags(tmp_path, fake_serve_forever):
    cfg = tmp_path / "motor.toml"
    cfg.write_text('max-weight = 4\nmax_queue_depth = 9\nworkspace-root = ["/a"]\n')
    assert main(["serve", "--config", str(cfg), "--max-weight", "6", "--state-dir", str(tmp_path),
                 "--caller-root", "/c=/h", "--isolation", "none"]) == 0
    [config] = fake_serve_forever
    assert config.max_weight == 6 and config.max_queue_depth == 9
    assert config.workspace_root == ["/a"] and config.caller_root == ["/c=/h"]
    assert config.state_dir == str(tmp_path) and config.isolation == "none"


def test_serve_start_up_failure_is_one_line(tmp_path, fake_serve_forever, capsys):
    assert main(["serve", "--state-dir", str(tmp_path), "--isolation", "systemd"]) == 2
    assert "systemd is not available" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["run"], "needs a command"),
        (["run", "--"], "needs a command"),
        (["run", "--weight", "many", "--", "make"], "--weight"),
        (["run", "--kind", "huge", "--", "make"], "--kind"),
        (["run", "--env", "NOEQUALS", "--", "make"], "--env"),
        (["run", "--memory-max", "lots", "--", "make"], "--memory-max"),
        (["run", "--bundle", "src.tar", "--", "make"], "--bundle"),
        (["run", "--timeout", "inf", "--", "make"], "'inf' is not a finite number of seconds"),
        (["submit", "--timeout", "nan", "--", "make"], "'nan' is not a finite number of seconds"),
        (["run", "--queue-wait-limit", "1e400", "--", "make"], "--queue-wait-limit"),
        (["run", "--timeout", "-1", "--", "make"], "'-1' is not a finite number of seconds >= 0"),
        (["run", "--timeout", "soon", "--", "make"], "invalid seconds value"),
        (["status", "--", "make"], "takes no command"),
        (["attach"], "JOB"),
        # bytes a shell passed that are not UTF-8 (held as surrogates): before stop 60 a
        # traceback of UnicodeEncodeError
        (["run", "--", "echo", "caf\udce9"], "the command's word b'caf\\xe9' is not UTF-8"),
        (["submit", "--workspace", "w\udce9", "--", "make"], "--workspace b'w\\xe9' is not UTF-8"),
        (["run", "--sibling", "\udcff", "--", "make"], "--sibling b'\\xff' is not UTF-8"),
        (["run", "--env", "A=\udcff", "--", "make"], "--env b'A=\\xff' is not UTF-8"),
        (["task", "submit", "--project", ".", "--", "echo", "\udce9"], "is not UTF-8"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in one_error_line(capsys)


def test_job_options_become_the_request(tmp_path):
    parser = build_parser()
    args = parser.parse_args([
        "run", "--workspace", "app", "--weight", "4", "--queue-wait-limit", "30", "--timeout", "600",
        "--gate", "--kind", "warm_build", "--head", "--sibling", "lib", "--sibling", "tools",
        "--repository", "https://example.com/r.git", "--env", "A=1", "--env", "B=x=y",
        "--memory-max", "8G", "--spill-eligible",
    ])
    args.tail = ["make", "-j4", "--", "x"]
    req = commands.job_request(args)
    assert req.command == ["make", "-j4", "--", "x"]
    assert (req.workspace, req.weight_hint, req.queue_wait_limit_s, req.timeout_s) == ("app", 4, 30.0, 600.0)
    assert req.gate and req.kind == "warm_build" and req.workspace_kind == "head"
    assert req.siblings == ["lib", "tools"] and req.repository == "https://example.com/r.git"
    assert req.env == {"A": "1", "B": "x=y"} and req.memory_max_bytes == 8 * 1024**3
    assert req.spill_eligible


def test_main_splits_the_command_at_the_first_double_dash(monkeypatch):
    seen = {}

    def fake_run(args):
        seen["req"] = commands.job_request(args)
        return 0

    monkeypatch.setattr(commands, "cmd_run", fake_run)
    # handler is bound at parser build time: rebuild after patching
    assert main(["run", "--workspace", "w", "--", "sh", "-c", "echo --", "--"]) == 0
    assert seen["req"].command == ["sh", "-c", "echo --", "--"]


# --- against a served fake runner -----------------------------------------------------------


async def test_run_streams_output_and_exits_with_the_jobs_status(live, config, capsys):
    assert await cli("run", "--socket", str(config.socket_path), "--workspace", "app", "--", "make") == 0
    out, err = capsys.readouterr()
    assert out == "hello\n"
    assert err == "warning: é\n"
    req, follow = live.submitted[0]
    assert req.command == ["make"] and req.workspace == "app" and follow is True
    assert req.capabilities == ["gate_jobs", "follow", "withdraw"]


@pytest.mark.parametrize(
    "script, status, line",
    [
        (exits(3), 3, None),
        (exits(None, signal=9, reason="oom_killed"), 137, "killed by signal 9 (oom_killed)"),
        (exits(None, signal=9, detail="the runner stopped the job's processes"), 137,
         "killed by signal 9: the runner stopped the job's processes"),
        (exits(None, state="timed_out", signal=9), 124, "timed out"),
        (exits(None, state="lost", detail="runner restarted"), 70, "was lost: runner restarted"),
        (exits(None, state="refused_before_start", reason="workspace_setup_failed", detail="clone failed"),
         75, "motor: refused: workspace_setup_failed: clone failed"),
    ],
)
async def test_run_exit_statuses(live, config, capsys, script, status, line):
    live.script = script
    assert await cli("run", "--socket", str(config.socket_path), "--", "x") == status
    err = capsys.readouterr().err
    if line is None:
        assert err == ""
    else:
        assert line in err and len(err.splitlines()) == 1


async def test_run_refused_at_submit(live, config, capsys):
    live.refusal = Refusal(code="runner_full", detail="64 jobs queued")
    assert await cli("run", "--socket", str(config.socket_path), "--", "x") == 75
    assert capsys.readouterr().err == "motor: refused: runner_full: 64 jobs queued\n"


@pytest.mark.parametrize("command", ["run", "submit"])
async def test_a_submit_unconfirmed_names_the_key_that_makes_sending_it_again_safe(
        live, config, capsys, command):
    live.refusal = Refusal(code="submit_unconfirmed", detail="not confirmed within 330 s")
    assert await cli(command, "--socket", str(config.socket_path), "--", "x") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "motor: refused: submit_unconfirmed: not confirmed within 330 s"
    assert err[1].startswith("motor: the runner may still accept the job; submitting it again "
                             "with --idempotency-key ")
    key = err[1].split("--idempotency-key ")[1].split()[0]
    assert len(key) == 32 and int(key, 16) >= 0  # the key the CLI sent (16 random bytes)
    # sent again with it (the fake keeps no keys: here the runner says the same again)
    assert await cli(command, "--socket", str(config.socket_path), "--idempotency-key", key,
                     "--", "x") == 1
    assert f"--idempotency-key {key} " in capsys.readouterr().err


async def test_run_bad_request_exits_65(live, config, capsys):
    assert await cli("run", "--socket", str(config.socket_path), "--workspace", "a/b", "--", "x") == 65
    assert capsys.readouterr().err.startswith("motor: refused: bad_request: workspace 'a/b'")


async def test_run_without_a_runner_exits_69(short_dir, capsys):
    assert await cli("run", "--socket", str(short_dir / "none.sock"), "--", "x") == 69
    assert "no runner answered" in capsys.readouterr().err


async def test_motor_socket_env_is_used(live, config, capsys, monkeypatch):
    monkeypatch.setenv("MOTOR_SOCKET", str(config.socket_path))
    assert await cli("health", "--json") == 0
    assert json.loads(capsys.readouterr().out)["isolation"] == "none"


async def test_run_json_prints_events(live, config, capsys):
    assert await cli("run", "--socket", str(config.socket_path), "--json", "--", "make") == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "accepted" and lines[0]["seq"] == 0
    assert lines[-1]["event"] == "terminal" and lines[-1]["record"]["state"] == "succeeded"
    assert any(e["event"] == "output" and e["data"] == "hello\n" for e in lines)


async def test_run_withdraws_when_the_queue_wait_budget_passes(live, config, capsys):
    live.script = queue_then_withdraw
    with trio.fail_after(10):
        status = await cli("run", "--socket", str(config.socket_path), "--", "x")
    assert status == 75
    assert "motor: refused: queue_wait_exceeded:" in capsys.readouterr().err
    [job] = live.jobs_by_id.values()
    assert job.withdrawn.is_set()


async def test_run_ctrl_c_cancels_the_job(live, config, capsys, monkeypatch):
    live.script = wait_for_cancel
    real_follow = commands.follow

    def interrupted_follow(events, **kwargs):
        def until_output():
            for event in events:
                yield event
                if event["event"] == "output":  # the CLI follows the wire's dicts
                    raise KeyboardInterrupt
        return real_follow(until_output(), **kwargs)

    monkeypatch.setattr(commands, "follow", interrupted_follow)
    assert await cli("run", "--socket", str(config.socket_path), "--", "x") == 130
    [job] = live.jobs_by_id.values()
    assert job.cancelled.is_set()
    assert "cancelled job" in capsys.readouterr().err


async def test_submit_prints_the_job_id(live, config, capsys):
    assert await cli("submit", "--socket", str(config.socket_path), "--", "make") == 0
    [job_id] = live.jobs_by_id
    assert capsys.readouterr().out == job_id + "\n"
    assert await cli("submit", "--socket", str(config.socket_path), "--json", "--", "make") == 0
    record = json.loads(capsys.readouterr().out)
    assert record["state"] and record["capabilities"] == ["gate_jobs", "follow", "withdraw"]


async def test_attach_replays_and_follows(live, config, capsys):
    await cli("submit", "--socket", str(config.socket_path), "--", "make")
    [job_id] = live.jobs_by_id
    capsys.readouterr()
    await trio.sleep(0.05)
    assert await cli("attach", job_id, "--socket", str(config.socket_path), "--from-seq", "4") == 0
    out, err = capsys.readouterr()
    assert out == "" and err == "warning: é\n"  # seq 3 was stdout, seq 4 is stderr
    assert await cli("attach", job_id, "--socket", str(config.socket_path)) == 0
    assert capsys.readouterr().out == "hello\n"


async def test_attach_history_expired_exits_1(live, config, capsys):
    live.expired.add("old")
    assert await cli("attach", "old", "--socket", str(config.socket_path)) == 1
    assert capsys.readouterr().err == "motor: history_expired: job old is past retention\n"
    assert await cli("attach", "nope", "--socket", str(config.socket_path)) == 1
    assert capsys.readouterr().err == "motor: refused: not_found: no job nope\n"


async def test_cancel_and_withdraw_commands(live, config, capsys):
    await cli("submit", "--socket", str(config.socket_path), "--", "make")
    [job_id] = live.jobs_by_id
    capsys.readouterr()
    assert await cli("withdraw", job_id, "--socket", str(config.socket_path)) == 0
    assert capsys.readouterr().out == "withdrawn\n"
    live.withdraw_result = "started"
    assert await cli("withdraw", job_id, "--socket", str(config.socket_path), "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"result": "started"}
    assert await cli("cancel", job_id, "--socket", str(config.socket_path)) == 0
    assert capsys.readouterr().out.strip() in ("succeeded", "cancelled")
    assert await cli("cancel", "nope", "--socket", str(config.socket_path)) == 1


@pytest.mark.parametrize("command", ["status", "jobs", "health", "workspaces"])
async def test_read_commands_text_and_json(live, config, capsys, command):
    live.script = wait_for_cancel
    await cli("submit", "--socket", str(config.socket_path), "--", "make", "[x]")
    capsys.readouterr()
    assert await cli(command, "--socket", str(config.socket_path)) == 0
    text = capsys.readouterr().out
    assert text.strip()
    assert await cli(command, "--socket", str(config.socket_path), "--json") == 0
    data = json.loads(capsys.readouterr().out)
    if command == "status":
        assert data["running"][0]["command"] == ["make", "[x]"]
        assert "make [x]" in text
    elif command == "jobs":
        assert data[0]["job_id"] in text
    elif command == "health":
        assert data["isolation"] == "none" and "isolation" in text and "capacity" in text
    else:
        assert data[0]["name"] == "default" and "default" in text and "12.1 KiB" in text


async def test_jobs_all_flag(live, config, capsys):
    assert await cli("jobs", "--all", "--socket", str(config.socket_path)) == 0
    assert live.jobs_calls == [True]


def test_serve_finds_socket_in_use_behind_a_supervisor_escalation(tmp_path, monkeypatch, capsys):
    from motor.api import SocketInUse

    module = types.ModuleType("motor.runner")

    async def serve_forever(config):
        try:
            raise SocketInUse(f"another runner is listening on {config.socket_path}")
        except SocketInUse as exc:
            escalation = RuntimeError("supervisor 'api' exceeded its restart intensity")
            escalation.__cause__ = exc
            raise ExceptionGroup("nursery", [escalation])

    module.serve_forever = serve_forever
    monkeypatch.setitem(sys.modules, "motor.runner", module)
    monkeypatch.setattr(motor, "runner", module, raising=False)
    assert main(["serve", "--state-dir", str(tmp_path)]) == 1
    assert "another runner is listening on" in one_error_line(capsys)


def test_listen_on_loopback_needs_no_token_file_elsewhere_it_does():
    from motor.config import ConfigError, build_config

    for listen in ("127.0.0.1:8080", "127.0.0.2:8080", "localhost:8080", "[::1]:8080"):
        assert build_config({}, {"listen": listen}).listen == listen
    for listen in ("0.0.0.0:8080", "[::]:8080", "10.0.0.5:8080", "build-host:8080",
                   "127.0.0.1.nip.io:8080"):
        with pytest.raises(ConfigError, match="--token-file"):
            build_config({}, {"listen": listen})
        assert build_config({}, {"listen": listen, "token_file": "/etc/motor/token"}).listen == listen


@pytest.mark.parametrize("content, needle", [(None, "cannot read token file"),
                                             ("  \n", "is empty")])
def test_serve_refuses_a_token_file_it_cannot_use_in_one_line(tmp_path, capsys, content, needle):
    """Before stop 57 the API actor found it, crashed at each restart with a traceback, and
    only then did serve exit 2."""
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    argv = ["serve", "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0",
            "--token-file", str(token)]
    assert main(argv) == 2
    assert needle in one_error_line(capsys)
    assert not (tmp_path / "state").exists()  # nothing started


def test_serve_refuses_a_listen_address_in_use_in_one_line(tmp_path, capsys):
    """Before stop 57: the API actor's crash loop (a traceback per restart), then exit 3,
    which a service manager restarts for ever."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--state-dir", str(tmp_path / "state"), "--isolation", "none",
                     "--listen", f"127.0.0.1:{port}"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in one_error_line(capsys)
