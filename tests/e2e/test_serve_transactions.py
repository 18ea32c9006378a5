"""Issue 14 (stop 29) through a real `motor serve` and its CLI: the store's transactions
per job, read from `motor health --json` (`store.commits`).

- a lone `true` job on an idle runner costs two: its acceptance with its start (`setup`,
  one save since stop 37: docs/scheduling.md, "Admission and the disk"), and its end,
  which carries its `running` record (docs/keeper.md, "The start's record goes with the
  job's next write");
- a job's end and the next job's start are one (docs/scheduling.md, "A job's end rides with
  the next start"): a job holding all the capacity, a second one queued behind it, then
  released, cost three more between them: the second's acceptance, the first's end with
  the second's start, the second's end.

A job that outlasts an output poll has its `running` saved alone, so a slow host (stop 82:
keeperd held 0.2 s before each job's status was written) made these counts one more; the
runners here stretch the poll (`output_poll_s`), as the in-process copies do.
"""

from __future__ import annotations

import json
import time

import pytest

from motor.config import OUTPUT_POLL_S, ConfigError, RunnerConfig, build_config
from polling import wait_for

pytestmark = pytest.mark.e2e


def _commits(serve) -> int:
    return serve.cli_json("health")["store"]["commits"]


def _state(serve, job_id: str) -> str:
    return next(j["state"] for j in _jobs(serve) if j["job_id"] == job_id)


def _replayed(serve, job_id: str) -> list[str]:
    """The kinds of the job's stored events, in order (`motor attach --json`)."""
    replay = serve.cli("attach", "--json", job_id)
    return [json.loads(line)["event"] for line in replay.stdout.splitlines()]


def _jobs(serve) -> list[dict]:
    got = serve.cli_json("jobs", "--all")
    return got if isinstance(got, list) else got["jobs"]


def _serve(serve_factory, tmp_path):
    config = tmp_path / "motor.toml"
    config.write_text("output_poll_s = 30\n")
    return serve_factory("--max-weight", "2", "--config", str(config)).start()


def test_the_output_poll_is_20_ms_unless_set_and_must_be_positive():
    assert RunnerConfig().output_poll_s == OUTPUT_POLL_S == 0.02
    assert build_config({"output_poll_s": 30}, {}).output_poll_s == 30
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match="output_poll_s"):
            build_config({"output_poll_s": bad}, {})


def test_a_quiet_jobs_start_waits_for_the_poll_the_config_sets(serve_factory, tmp_path):
    """Through `motor serve` with `output_poll_s = 30`: a running job that writes nothing
    has its `running` record saved alone only after a poll, so for 0.3 s, fifteen of the
    default 20 ms polls, its record stays in `setup` and nothing is committed; its end
    then saves its start with it, in order."""
    serve = _serve(serve_factory, tmp_path)
    go, up = tmp_path / "go", tmp_path / "up"
    job_id = serve.cli_json("submit", "--weight", "1", "--", "sh", "-c",
                            f"touch {up}; while [ ! -e {go} ]; do sleep 0.01; done")["job_id"]
    serve.wait_until_it_runs(job_id)
    wait_for(up.exists, what="the job to run")
    before = _commits(serve)
    time.sleep(0.3)
    assert _state(serve, job_id) == "setup" and _commits(serve) == before
    go.touch()
    assert _replayed(serve, job_id) == ["accepted", "queued", "started", "terminal"]
    assert _state(serve, job_id) == "succeeded"


def test_a_lone_true_job_costs_two_transactions(serve_factory, tmp_path):
    serve = _serve(serve_factory, tmp_path)
    assert serve.cli("run", "--", "true").returncode == 0  # warm
    before = _commits(serve)
    assert serve.cli("run", "--", "true").returncode == 0
    assert _commits(serve) - before == 2
    # nothing of the acceptance is missing from the one save: its events replay first
    job_id = max(j["job_id"] for j in _jobs(serve))
    assert _replayed(serve, job_id) == ["accepted", "queued", "started", "terminal"]
    assert _state(serve, job_id) == "succeeded"


def test_a_jobs_end_and_the_next_jobs_start_are_one_transaction(serve_factory, tmp_path):
    serve = _serve(serve_factory, tmp_path)
    go = tmp_path / "go"
    first = serve.cli_json("submit", "--weight", "2", "--", "sh", "-c",
                           f"while [ ! -e {go} ]; do sleep 0.01; done")["job_id"]
    serve.wait_until_it_runs(first)  # its record says `setup` until the poll or its end
    before = _commits(serve)
    second = serve.cli_json("submit", "--weight", "2", "--", "true")["job_id"]
    assert _state(serve, second) == "queued"
    go.touch()
    assert serve.cli("attach", second).returncode == 0
    assert _state(serve, first) == "succeeded" and _state(serve, second) == "succeeded"
    assert _commits(serve) - before == 3
