"""Issue 14 (start latency): the runner writes no spec.json on a start's path; the job's
spec goes to keeperd in the spawn request, and keeperd leaves it as spec.json once the job
is on its way. Through the real embedded runner and keeperd. (`motor serve`'s spec.json,
private and holding the job's environment, is checked by tests/store/test_permissions.py.)
"""

from __future__ import annotations

import json
import os

import motor
from motor.execution import keeperd_client
from motor.records import JobRequest
from runner_helpers import embedded_config, terminal_of


async def test_a_start_hands_keeperd_its_spec_and_writes_no_spec_json_itself(tmp_path, monkeypatch):
    seen = []
    spawn = keeperd_client.KeeperdSpawner.spawn

    async def noting_spawn(self, job_dir, spec=None):
        seen.append((os.path.exists(os.path.join(job_dir, "spec.json")), spec))
        return await spawn(self, job_dir, spec)

    monkeypatch.setattr(keeperd_client.KeeperdSpawner, "spawn", noting_spawn)
    async with motor.open_runner(embedded_config(tmp_path, max_weight=2)) as runner:
        job = await runner.submit(JobRequest(command=["sh", "-c", 'echo "$MOTOR_JOB_ID"'],
                                             weight_hint=1, env={"PROBE": "yes"}))
        record = await terminal_of(runner, job.job_id)
        assert record["state"] == "succeeded"
        [(existed, spec)] = seen
        assert not existed and spec["command"] == ["sh", "-c", 'echo "$MOTOR_JOB_ID"']
        assert spec["env"]["PROBE"] == "yes" and spec["env"]["MOTOR_JOB_ID"] == job.job_id
        written = tmp_path / "state" / "jobs" / job.job_id / "spec.json"
        assert json.loads(written.read_text()) == spec
