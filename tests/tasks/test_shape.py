"""The task client keeps the shape of docs/architecture.md (issue 15): each shell file under
200 lines, the rules importable without trio (tests/tasks/test_rules.py), and the old import
path `motor.tasks.actor` still offering every name it offered."""

from __future__ import annotations

from pathlib import Path

import pytest

import motor.tasks.actor as actor

TASKS = Path(__file__).resolve().parents[2] / "motor" / "tasks"

#: the shells: actor classes and the thin layers that only carry messages
SHELLS = ("queue.py", "client.py", "turn.py", "detached.py", "actor.py")


@pytest.mark.parametrize("name", SHELLS)
def test_every_shell_is_under_200_lines(name):
    lines = (TASKS / name).read_text().count("\n")
    assert lines < 200, f"motor/tasks/{name} has {lines} lines"


def test_the_old_import_path_keeps_its_public_names():
    assert set(actor.__all__) == {
        "QueueActor", "QueueHandle", "open_queue", "TaskClient", "TurnRunner", "StartResult", "run_turn",
        "detached_runner", "start_next_parked", "take_over_reserved_slot", "real_spawner", "make_bundle",
        "probe_health", "retire", "complete_locked", "take_over_locked", "reconcile_plan", "next_parked_locked",
        "claim_locked", "task_facts", "Claimed", "host_turn", "resolve_project"}
    assert all(getattr(actor, name) is not None for name in actor.__all__)
