"""Every example in examples/ is run here (the actors one in test_examples_actors.py)."""

from __future__ import annotations

import configparser
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from motor.config import RunnerConfig, build_config, load_toml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_every_example_is_covered():
    # motor-jobs.slice (and motor.service under a real systemd) run in
    # tests/isolation/test_isolation_systemd_host.py
    covered = {"actors_pipeline.py", "embed.py", "motor.service", "motor-jobs.slice",
               "runner.toml", "workers.toml"}
    assert {p.name for p in EXAMPLES.iterdir()} == covered


def test_embed_example_runs_a_job_through_the_embedding_api():
    result = subprocess.run([sys.executable, str(EXAMPLES / "embed.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "built 1 vCPUs" in result.stdout
    assert "state: succeeded exit: 0" in result.stdout
    assert "recorded: succeeded on cpus [" in result.stdout
    assert "refused: runner_full" in result.stdout
    assert "held permits after the job: 0" in result.stdout


def test_embedding_doc_shows_the_example_that_runs():
    """docs/embedding.md quotes examples/embed.py whole: the code a reader copies is the
    code the test above runs."""
    doc = (EXAMPLES.parent / "docs" / "embedding.md").read_text()
    blocks = doc.split("```python\n")[1:]
    quoted = [block.split("```", 1)[0] for block in blocks]
    assert (EXAMPLES / "embed.py").read_text() in quoted


def test_embedding_doc_names_every_runner_method():
    from motor.runner import Runner

    doc = (EXAMPLES.parent / "docs" / "embedding.md").read_text()
    public = [name for name in vars(Runner) if not name.startswith("_")]
    assert public and not [name for name in public
                           if f"`{name}(" not in doc and f"`{name}`" not in doc]


def test_runner_toml_is_a_valid_config():
    values = load_toml(EXAMPLES / "runner.toml")
    config = build_config(values, {})
    assert isinstance(config, RunnerConfig)
    assert config.max_weight == 28 and config.isolation == "auto"


def test_workers_toml_is_a_valid_fleet():
    from motor.tasks.workers import load_fleet

    fleet = load_fleet(EXAMPLES / "workers.toml")
    assert fleet.names == ["mini-1", "mini-2"]
    assert fleet.get("mini-2").token_file == "/etc/motor/mini-2.token"
    assert fleet.max_parallel == {"nightly": 2}


def test_systemd_unit_starts_the_runner_it_names(tmp_path):
    """The unit's ExecStart, with the venv's python swapped for ours and the state dir and
    socket redirected to a temporary place, starts a runner that answers and stops on
    SIGTERM (KillMode=process: only the main process is signalled)."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(EXAMPLES / "motor.service")
    assert unit["Service"]["KillMode"] == "process"
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert argv[1:4] == ["-m", "motor", "serve"]
    config_arg = argv[argv.index("--config") + 1]
    assert config_arg == "/etc/motor/runner.toml"
    argv = [sys.executable, *argv[1:]]
    argv[argv.index("--config") + 1] = str(EXAMPLES / "runner.toml")
    state = tmp_path / "state"
    argv += ["--state-dir", str(state), "--free-space-floor-bytes", "0"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while b"listening on" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        health = subprocess.run(
            [sys.executable, "-m", "motor", "health", "--json", "--socket", str(state / "motor.sock")],
            capture_output=True, timeout=30)
        assert health.returncode == 0, health.stderr
        assert msgspec.json.decode(health.stdout)["capacity"]["max_weight"] == 28
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
