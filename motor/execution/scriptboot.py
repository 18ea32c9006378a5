"""Start-up of the keeper-side programs run by path (forkserver.py, keeperd.py).

`python -m motor.execution.forkserver` would execute `motor/__init__.py` and
`motor/execution/__init__.py` first, which pull in the runner (trio, msgspec, sqlite, ...).
These programs must stay small (keepers are forked from them), so when run by path they
register bare namespace stubs for the two packages: the stdlib-only modules (`keeper`,
`joblog`, `faults`, `isolation.join`) then load from their files without running any
package `__init__`. Stdlib only; imported as a sibling (the script's directory is
`sys.path[0]` when Python runs a file), before anything of motor.
"""

from __future__ import annotations

import os
import sys
import types


def bootstrap(script_file: str) -> None:
    here = os.path.dirname(os.path.abspath(script_file))
    # Script mode puts our own directory first on sys.path: drop it so no sibling module
    # can shadow a stdlib one.
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]
    for name, path in (("motor", os.path.dirname(here)), ("motor.execution", here)):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            mod.__package__ = name
            sys.modules[name] = mod
