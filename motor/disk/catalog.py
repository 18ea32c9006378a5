"""The workspace catalog: which trees the runner made, and so may evict.

One JSON file, `<state>/disk/catalog.json`, written atomically (write, rename) by the
disk actor only. Each entry: the catalog key (`name`: the workspace name, or the caller's
path for a workspace served through a caller root), `path` (the canonical host path of the
tree), `root` (the allowed root it lives under: a workspace root or a caller root's host
directory), `kind` (`task` | `head` | `snapshot`), `caller_path` (or null), `created_ms`,
`last_used_ms`, and for snapshots `referenced_by`. A directory that is not catalogued is
never removed, whatever its size.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Entry:
    name: str
    path: str
    root: str
    kind: str = "task"
    caller_path: str | None = None
    created_ms: int = 0
    last_used_ms: int = 0
    referenced_by: list[str] = field(default_factory=list)


class Catalog:
    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir) / "disk"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "catalog.json"
        self.entries: dict[str, Entry] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        for item in data.get("workspaces", []):
            try:
                entry = Entry(**item)
            except TypeError:
                continue
            self.entries[entry.name] = entry

    def save(self) -> None:
        tmp = self.path.with_name(f"catalog.json.{uuid.uuid4().hex[:8]}")
        body = json.dumps({"workspaces": [asdict(e) for e in self.entries.values()]},
                          sort_keys=True, indent=1)
        with open(tmp, "w") as f:  # no fsync: a lost entry after a crash only means a tree
            f.write(body)          # that is never evicted, the safe direction
        os.replace(tmp, self.path)

    def get(self, name: str) -> Entry | None:
        return self.entries.get(name)

    def by_path(self, path: str) -> Entry | None:
        for e in self.entries.values():
            if e.path == path:
                return e
        return None

    def record(self, name: str, path: str, root: str, *, kind: str, now_ms: int,
               caller_path: str | None = None) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            entry = Entry(name=name, path=path, root=root, kind=kind, caller_path=caller_path,
                          created_ms=now_ms, last_used_ms=now_ms)
            self.entries[name] = entry
        else:
            changed = (entry.path, entry.root, entry.kind) != (path, root, kind) or (
                caller_path is not None and caller_path != entry.caller_path)
            entry.path, entry.root, entry.kind = path, root, kind
            entry.caller_path = caller_path or entry.caller_path
            entry.last_used_ms = max(entry.last_used_ms, now_ms)
            if not changed:  # last use is saved when the job goes idle (JobIdle)
                return entry
        self.save()
        return entry

    def touch(self, name: str, now_ms: int) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.last_used_ms = max(entry.last_used_ms, now_ms)
            self.save()

    def forget(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self.save()
