"""Issue 14's runner rules through a real `motor serve` and its HTTP API:

- two clients following one job live over `GET /v1/jobs/{id}/events` (a caught-up
  follower takes the events from the store's hub, not from SQLite) get exactly the events
  a replay from the database gives afterwards, in order, once each;
- `motor health --json` shows the state directory's file system (`disk.state_filesystem`),
  read as findmnt(8) reads it, and the runner's log warns only where ext4 has no journal.
"""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest

from motor.client import Client
from polling import wait_for

pytestmark = pytest.mark.e2e


def test_two_live_followers_over_http_get_what_a_replay_gets(serve, tmp_path):
    gate = tmp_path / "gate"
    script = (f"echo first; while [ ! -e {gate} ]; do sleep 0.01; done;"
              " i=0; while [ $i -lt 25 ]; do i=$((i+1)); echo line$i; echo err$i >&2;"
              " sleep 0.005; done; exit 3")
    client = Client(serve.socket, timeout=60)
    job_id = client.submit({"command": ["sh", "-c", script], "workspace": "w"}, raw=True)["job_id"]
    seen: dict[str, list[dict]] = {"a": [], "b": []}

    def follow(name: str) -> None:
        for event in Client(serve.socket, timeout=60).events(job_id, raw=True):
            seen[name].append(event)

    threads = [threading.Thread(target=follow, args=(name,), daemon=True) for name in seen]
    threads[0].start()
    wait_for(lambda: any(e["event"] == "output" for e in seen["a"]), what="a's first output")
    threads[1].start()
    wait_for(lambda: any(e["event"] == "output" for e in seen["b"]), what="b's first output")
    gate.touch()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    replay = list(client.events(job_id, raw=True))  # the job has ended: all from SQLite
    assert replay[-1]["event"] == "terminal" and replay[-1]["record"]["exit_code"] == 3
    assert seen["a"] == seen["b"] == replay
    assert [e["seq"] for e in replay] == list(range(1, len(replay) + 1))
    out = "".join(e["data"] for e in replay if e["event"] == "output" and e["stream"] == "stdout")
    assert out.split() == ["first", *(f"line{i}" for i in range(1, 26))]


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="no findmnt(8)")
def test_health_shows_the_state_file_system_and_the_log_warns_only_without_a_journal(serve):
    health = serve.cli_json("health")
    fs = health["disk"]["state_filesystem"]
    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,TARGET", "-T", str(serve.state_dir)],
                           capture_output=True, text=True, check=True).stdout.split()
    assert [fs["type"], fs["mount_point"]] == found[:2]
    warned = "without a journal" in serve.log.read_text()
    assert warned is (fs.get("journal") is False)
