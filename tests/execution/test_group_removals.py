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


def _logged(*needles: str):
    """A log callback, its lines, and per needle an Event set once a line containing it is
    logged (by the remover's own thread)."""
    lines: list[str] = []
    seen = {needle: threading.Event() for needle in needles}

    def log(line: str) -> None:
        lines.append(line)
        for needle, event in seen.items():
            if needle in line:
                event.set()
    return lines, log, seen


def test_a_group_busy_past_its_deadline_is_removed_on_a_later_try(groups, monkeypatch):
    """A group still busy after `DEADLINE_S` is logged and tried again while keeperd runs:
    once its task has left, a later try removes it, with no runner start in between.
    (Before, it stayed until the runner's next start-up sweep.)"""
    monkeypatch.setattr(removals, "DEADLINE_S", 0.2)
    monkeypatch.setattr(removals, "RETRY_EVERY_S", 0.1)
    lines, log, seen = _logged("tried again every 0.1 s", "on a later try")
    remover = GroupRemover(log)
    busy = _sleeper_in(groups["a"])
    try:
        remover.remove({"memory": groups["a"]})
        assert seen["tried again every 0.1 s"].wait(30)
        assert os.path.isdir(groups["a"]) and not seen["on a later try"].is_set()
    finally:
        busy.kill()
        busy.wait()
    assert seen["on a later try"].wait(30)
    remover.close()
    assert not os.path.exists(groups["a"])
    assert lines[-1] == f"removed {groups['a']} on a later try"


def test_a_group_busy_through_all_its_tries_is_logged_for_the_sweep(groups, monkeypatch):
    """A group that stays busy for `RETRY_FOR_S` of tries is given up on, logged for the
    runner's next start-up sweep, and the remover goes on with the next removal."""
    monkeypatch.setattr(removals, "DEADLINE_S", 0.2)
    monkeypatch.setattr(removals, "RETRY_EVERY_S", 0.1)
    monkeypatch.setattr(removals, "RETRY_FOR_S", 0.3)
    lines, log, seen = _logged("of tries")
    remover = GroupRemover(log)
    busy = _sleeper_in(groups["a"])
    try:
        remover.remove({"memory": groups["a"]})
        assert seen["of tries"].wait(30)
        remover.remove({"memory": groups["b"]})
        remover.close()
        assert os.path.isdir(groups["a"]) and not os.path.exists(groups["b"])
    finally:
        busy.kill()
        busy.wait()
    first, last = lines[0], lines[-1]
    assert first.startswith(f"cannot remove {groups['a']}") and "tried again" in first
    assert last == (f"cannot remove {groups['a']} after 0.3 s of tries: the runner's next "
                    "start-up sweep removes it")
    assert len(lines) == 2  # no line per try
