"""`C/workers.toml`: the fleet.

    [[workers]]
    name = "mini-1"
    endpoint = "unix:/var/lib/motor/motor.sock"     # or "http://host:port"
    token_file = "/etc/motor/mini-1.token"          # optional (bearer token for http)
    capabilities = ["macos", "xcode"]                # optional

    [runs.nightly]                                   # optional: per-run limits
    max_parallel = 2

Errors name the file and, where there is one, the line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from motor.records import valid_workspace_name

__all__ = ["WorkerSpec", "Fleet", "FleetError", "load_fleet"]


class FleetError(Exception):
    """workers.toml is missing, unreadable or malformed: one line naming file (and line)."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    endpoint: str
    token_file: str | None = None
    capabilities: tuple[str, ...] = ()

    def token(self) -> str | None:
        if not self.token_file:
            return None
        with open(self.token_file) as f:
            return f.read().strip()


@dataclass(frozen=True)
class Fleet:
    workers: tuple[WorkerSpec, ...]
    max_parallel: dict[str, int] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def capable(self, capabilities) -> list[WorkerSpec]:
        """The workers that list every one of `capabilities`."""
        need = set(capabilities)
        return [w for w in self.workers if need <= set(w.capabilities)]

    def get(self, name: str) -> WorkerSpec | None:
        for w in self.workers:
            if w.name == name:
                return w
        return None


def _nth_header_line(text: str, header: str, n: int) -> int | None:
    count = 0
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith(header):
            if count == n:
                return i
            count += 1
    return None


def load_fleet(path: Path) -> Fleet:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FleetError(f"{path}: no such file (list the workers there: [[workers]] name, endpoint)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        where = f"{path}:{m.group(1)}" if m else str(path)
        raise FleetError(f"{where}: {msg}") from None
    workers = data.get("workers")
    if not isinstance(workers, list) or not workers:
        raise FleetError(f"{path}: no [[workers]] table (each needs name and endpoint)")
    specs: list[WorkerSpec] = []
    for i, w in enumerate(workers):
        line = _nth_header_line(text, "[[workers]]", i)
        where = f"{path}:{line}" if line else str(path)
        if not isinstance(w, dict):
            raise FleetError(f"{where}: workers must be tables")
        name, endpoint = w.get("name"), w.get("endpoint")
        if not isinstance(name, str) or not valid_workspace_name(name):
            raise FleetError(f"{where}: worker name must be a plain name like mini-1, got {name!r}")
        if not isinstance(endpoint, str) or not (endpoint.startswith("unix:/") or
                                                 endpoint.startswith(("http://", "https://"))):
            raise FleetError(f"{where}: worker {name}: endpoint must be unix:/path or http://host:port, "
                             f"got {endpoint!r}")
        token_file = w.get("token_file")
        if token_file is not None and not isinstance(token_file, str):
            raise FleetError(f"{where}: worker {name}: token_file must be a path")
        caps = w.get("capabilities", [])
        if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
            raise FleetError(f"{where}: worker {name}: capabilities must be a list of strings")
        unknown = set(w) - {"name", "endpoint", "token_file", "capabilities"}
        if unknown:
            raise FleetError(f"{where}: worker {name}: unknown key {sorted(unknown)[0]!r}")
        if any(s.name == name for s in specs):
            raise FleetError(f"{where}: worker {name} is listed twice")
        specs.append(WorkerSpec(name, endpoint, token_file, tuple(caps)))
    max_parallel: dict[str, int] = {}
    runs = data.get("runs", {})
    if not isinstance(runs, dict):
        raise FleetError(f"{path}: runs must be a table of [runs.NAME] tables")
    for run, spec in runs.items():
        line = _nth_header_line(text, f"[runs.{run}]", 0)
        where = f"{path}:{line}" if line else str(path)
        value = spec.get("max_parallel") if isinstance(spec, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FleetError(f"{where}: run {run}: max_parallel must be an integer >= 1")
        max_parallel[run] = value
    return Fleet(tuple(specs), max_parallel)
