"""Queue-wait clocks across an orderly restart of `motor serve` (stop 23): clocks that
change within `clock_save_s` of the last clock save are saved together at its end, and a
runner stopped by SIGTERM before then saves them on its way out, so the restarted one
resumes each clock from its course at the stop (an advancing clock with the downtime)."""

from __future__ import annotations

import signal
import time

import pytest

from motor.config import ConfigError, RunnerConfig, build_config
from motor.scheduling.machine import CLOCK_SAVE_S
from polling import wait_for

pytestmark = pytest.mark.e2e


def _barrier(serve, workspace: str, gate) -> dict:
    return serve.cli_json("submit", "--weight", "1", "--workspace", workspace, "--",
                          "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.01; done")


def _queued(serve, job_id: str) -> dict | None:
    return next((r for r in serve.cli_json("status")["queued"] if r["job_id"] == job_id), None)


def _running(serve) -> set[str]:
    return {r["job_id"] for r in serve.cli_json("status")["running"]}


def test_the_default_window_is_the_machines_and_a_negative_one_is_refused():
    assert RunnerConfig().clock_save_s == CLOCK_SAVE_S
    assert build_config({"clock_save_s": 0}, {}).clock_save_s == 0  # every change at once
    with pytest.raises(ConfigError, match="clock_save_s"):
        build_config({"clock_save_s": -1}, {})


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGHUP, 129)],
                         ids=["SIGTERM", "SIGHUP"])
def test_a_clock_change_waiting_for_its_save_is_saved_by_an_orderly_stop(
        serve_factory, tmp_path, sig, status):
    """With a window of an hour, only the first clock change is saved at once. q pauses
    behind its workspace's owner w (saved at once); w is cancelled and y of another
    workspace takes the slot, so q advances again: that change waits for the window. The
    runner is stopped (SIGTERM; or SIGHUP, a hang-up, which stops it as orderly since stop
    52 and exits 129, where it killed it on the spot), down for 2 s, started again: q's
    clock resumes advancing from the stop, the downtime included (saved as paused, it would
    resume near 0)."""
    config = tmp_path / "motor.toml"
    config.write_text("clock_save_s = 3600\n")
    serve = serve_factory("--max-weight", "1", "--config", str(config)).start()
    holder = _barrier(serve, "blk", tmp_path / "go-blk")
    wait_for(lambda: _running(serve) == {holder["job_id"]}, what="the holder to run")
    w = _barrier(serve, "b", tmp_path / "go-w")
    q = serve.cli_json("submit", "--weight", "1", "--workspace", "b", "--", "true")
    y = _barrier(serve, "a", tmp_path / "go-y")
    (tmp_path / "go-blk").write_text("")
    wait_for(lambda: _running(serve) == {w["job_id"]}, what="w to run")
    wait_for(lambda: (_queued(serve, q["job_id"]) or {}).get("waiting_on") == "workspace_owner",
             what="q to wait behind w (its clock paused)")
    assert serve.cli("cancel", w["job_id"]).returncode == 0
    wait_for(lambda: _running(serve) == {y["job_id"]}, what="y to take the slot")
    entry = _queued(serve, q["job_id"])
    assert entry is not None and entry["waiting_on"] == "permits"  # advancing again
    assert serve.stop(sig) == status
    assert "Traceback" not in serve.log.read_text()
    time.sleep(2.0)
    serve.start()
    resumed = _queued(serve, q["job_id"])
    assert resumed is not None and resumed["waiting_on"] == "permits"
    assert resumed["queue_wait_ms"] >= 2000, resumed  # the downtime: it was advancing
    (tmp_path / "go-y").write_text("")
    wait_for(lambda: not serve.cli_json("status")["queued"] and not _running(serve),
             what="q to run after y")
