"""The house's shape (docs/architecture.md, issue 15), checked on the source itself:

- every actor shell (a module defining an `actors.Actor` subclass) is under 200 lines;
- the pure cores import no trio, no actors runtime and no motor I/O module, checked in a
  fresh interpreter so nothing imported by another test hides a dependency;
- only motor/clock.py knows trio's MockClock (no test-mode branches in production code).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

MOTOR = Path(__file__).resolve().parent.parent / "motor"


def _defines_an_actor(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = ast.unparse(base)
                if name in ("actors.Actor", "Actor"):
                    return True
    return False


SHELLS = sorted(p for p in MOTOR.rglob("*.py") if _defines_an_actor(p))


def test_the_shells_are_found():
    names = {str(p.relative_to(MOTOR)) for p in SHELLS}
    assert {"scheduling/actor.py", "disk/actor.py", "execution/actor.py", "store/actor.py",
            "cpu/actor.py", "accounting/actor.py", "tasks/turn.py"} <= names


@pytest.mark.parametrize("path", SHELLS, ids=lambda p: str(p.relative_to(MOTOR)))
def test_every_actor_shell_is_under_200_lines(path):
    lines = path.read_text().count("\n")
    assert lines < 200, f"motor/{path.relative_to(MOTOR)} has {lines} lines"


PURE = ["motor.lifecycle", "motor.scheduling.core", "motor.scheduling.admission",
        "motor.scheduling.machine", "motor.cpu.core", "motor.cpu.topology", "motor.memory.core",
        "motor.disk.core", "motor.disk.book", "motor.disk.live", "motor.accounting.core",
        "motor.execution.core", "motor.tasks.core", "motor.tasks.rules", "motor.store.checkpoints",
        "motor.store.pace"]


@pytest.mark.parametrize("module", PURE)
def test_a_pure_core_imports_no_trio_and_no_actor_runtime(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m == 'trio' or m.startswith('trio.')"
            " or m == 'actors' or m.startswith('actors.'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"{module} imports {out}"


def test_only_the_clock_module_knows_mockclock():
    users = sorted(str(p.relative_to(MOTOR)) for p in MOTOR.rglob("*.py")
                   if "MockClock" in p.read_text())
    assert users == ["clock.py"]
