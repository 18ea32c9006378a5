"""The task client keeps the shape of docs/architecture.md (issue 15): each shell file under
200 lines (also the ones that define no actor class, which tests/test_shape.py does not
find), the rules importable without trio (tests/tasks/test_rules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "motor" / "tasks"

#: the shells: actor classes and the thin layers that only carry messages
SHELLS = ("queue.py", "client.py", "turn.py", "detached.py")


@pytest.mark.parametrize("name", SHELLS)
def test_every_shell_is_under_200_lines(name):
    lines = (TASKS / name).read_text().count("\n")
    assert lines < 200, f"motor/tasks/{name} has {lines} lines"
