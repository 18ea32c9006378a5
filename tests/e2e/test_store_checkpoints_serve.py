"""The job database's WAL checkpoints through a real `motor serve` (issue 14, stop 26;
docs/operations.md "The job database's checkpoints"): no commit checkpoints, the store
runs rounds in a worker thread (the runner's real clock), and they keep the WAL bounded
while a job's output is stored; health (`motor health --json`) and `GET /metrics` show
them. Real processes, the CLI and the HTTP client on the runner's socket.
"""

from __future__ import annotations

import pytest

from motor.client import Client

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024


def test_serve_checkpoints_in_the_background_and_keeps_the_wal_bounded(serve_factory):
    serve = serve_factory().start()
    size = 12 * MiB  # about 25 MiB of WAL frames if nothing checkpointed
    ran = serve.cli("run", "--", "sh", "-c", f"yes 0123456789abcdef | head -c {size}",
                    timeout=300)
    assert ran.returncode == 0, ran.stderr.decode()
    assert len(ran.stdout) == size

    wal = serve.state_dir / "motor.db-wal"
    assert wal.stat().st_size <= 10 * MiB  # 8 MiB (its bound) and a commit's frames

    health = serve.cli_json("health")
    assert health["status"] == "ok", health["degraded"]
    store = health["store"]
    assert store["checkpoints"] >= 1 and store["commits"] >= 8
    assert store["last_checkpoint"]["complete"] is True
    assert store["last_checkpoint"]["ms"] > 0

    with Client(serve.socket) as client:
        metrics = client.metrics()
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("motor_store_")}
    assert counts["motor_store_checkpoints_total"] >= 1
    assert counts["motor_store_commits_total"] >= store["commits"]
    assert counts["motor_store_last_checkpoint_seconds"] > 0
    assert serve.stop() == 0
    assert not wal.exists()  # the last close checkpointed what was left
