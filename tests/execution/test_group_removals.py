"""keeperd's group remover (motor/execution/removals.py) on real v1 groups: an empty group
goes; a busy one is retried until it empties, or given up on and logged for the sweep."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from motor.execution import removals
from motor.execution.removals import GroupRemover

MEMORY = "/sys/fs/cgroup/memory"

pytestmark = pytest.mark.skipif(not os.access(MEMORY, os.W_OK),
                                reason=f"needs a writable cgroup v1 memory hierarchy at {MEMORY}")


@pytest.fixture
def groups(tmp_path):
    """Two fresh groups under a private parent (removed, with what is in them, after)."""
    from private_cgroup import kill_and_remove, private_parent_name

    parent = os.path.join(MEMORY, private_parent_name())
    made = {name: os.path.join(parent, f"job-{name}") for name in ("a", "b")}
    for path in made.values():
        os.makedirs(path)
    yield made
    kill_and_remove(parent)


def _sleeper_in(group: str) -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "60"])
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(proc.pid))
    return proc


def test_the_remover_removes_empty_groups_and_waits_out_a_busy_one(groups):
    lines: list[str] = []
    remover = GroupRemover(lines.append)
    busy = _sleeper_in(groups["b"])
    try:
        remover.remove(groups)
        assert os.path.isdir(groups["b"])  # a task in it: retried until it leaves
        busy.kill()
        busy.wait()
        remover.close()
    finally:
        busy.kill()
        busy.wait()
    assert not os.path.exists(groups["a"]) and not os.path.exists(groups["b"])
    assert lines == []
    assert not remover.thread.is_alive()


def test_a_group_that_stays_busy_is_logged_for_the_sweep(groups, monkeypatch):
    monkeypatch.setattr(removals, "DEADLINE_S", 0.2)
    lines: list[str] = []
    done = threading.Event()
    remover = GroupRemover(lambda line: (lines.append(line), done.set()))
    busy = _sleeper_in(groups["a"])
    try:
        remover.remove({"memory": groups["a"]})
        assert done.wait(30)
    finally:
        busy.kill()
        busy.wait()
    remover.close()
    assert os.path.isdir(groups["a"])
    assert len(lines) == 1 and lines[0].startswith(f"cannot remove {groups['a']}")
    assert lines[0].endswith("the runner's next start-up sweep removes it")
