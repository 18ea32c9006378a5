"""The workspace catalog: which trees the runner made, and so may evict.

Two files under `<state>/disk/`, written by the disk actor only:

- `catalog.json`, the snapshot, written atomically (write, rename);
- `catalog.journal`, one JSON line per change since that snapshot: `{"put": {...entry}}` or
  `{"del": name}`. Each change (a new workspace, a job end's last-use time, an eviction) is
  one small append (O(1), one `write`), never a rewrite of the whole catalog.

Batching: the snapshot is rewritten only when the journal holds more lines than
`max(COMPACT_MIN, entries)` (so the rewrite costs O(1) amortized per change), and when the
actor stops. Loading reads the snapshot, then replays the journal in order; a torn last
line (a crash mid-append) is ignored. The operations are absolute (put the whole entry, or
delete it), so a crash between the snapshot's rename and the journal's truncation replays
changes the snapshot already has, harmlessly. What is guaranteed: every change is in the
journal before the actor answers or moves on, so a crash of the runner (not of the kernel:
there is no fsync, as before) right after a job end finds its workspace catalogued with that
last use. A lost entry after a power failure only means a tree that is never evicted, the
safe direction.

Each entry: the catalog key (`name`: the workspace name, or the caller's path for a workspace
served through a caller root), `path` (the canonical host path of the tree), `root` (the
allowed root it lives under: a workspace root or a caller root's host directory), `kind`
(`task` | `head` | `snapshot`), `caller_path` (or null), `created_ms`, `last_used_ms`, and
for snapshots `referenced_by`. A directory that is not catalogued is never removed, whatever
its size.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

log = logging.getLogger("motor.disk")


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


COMPACT_MIN = 256


def _entry(item) -> Entry | None:
    """A catalog entry from its JSON form, its fields of their types; None when it is not one."""
    try:
        return msgspec.convert(item, Entry)
    except msgspec.ValidationError:
        return None


#: at most this many names wait in `Catalog.added`; past it the generation moves instead
MAX_ADDED = 4096


class Catalog:
    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir) / "disk"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "catalog.json"
        self.journal_path = self.dir / "catalog.journal"
        self.entries: dict[str, Entry] = {}
        #: Bumped whenever a name is added, removed or gets another path or root.
        #: bumped when an entry's path or root changes or an entry goes (what a resolved name
        #: may have depended on); a new entry only joins `added`
        self.generation = 0
        #: names catalogued since the last `take_added()` (the live view re-resolves just those)
        self.added: list[str] = []
        self.journal_lines = 0
        self.compactions = 0
        #: why the last write of the catalog failed (None: it did not); health says it
        self.save_error: str | None = None
        self._load()

    def _load(self) -> None:
        """The snapshot, then the journal. What is not an entry of the right types (a torn
        last line, a file damaged or written by hand) is left out, and said once: a tree
        left out is not catalogued, so never evicted (the safe direction), and is catalogued
        again when a job uses it. (Before stop 48 a snapshot that was JSON but not an
        object, or an entry with a number for a path, crashed the disk or maintenance actor
        at every start until the runner stopped.)"""
        skipped = 0
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        items = data.get("workspaces") if isinstance(data, dict) else None
        if not isinstance(items, list):
            skipped += items is not None or not isinstance(data, dict)
            items = []
        for item in items:
            if (entry := _entry(item)) is None:
                skipped += 1
                continue
            self.entries[entry.name] = entry
        try:
            with open(self.journal_path) as f:
                lines = f.read().splitlines()
        except (OSError, ValueError):
            lines = []
        for i, line in enumerate(lines):
            try:
                op = json.loads(line)
            except ValueError:
                op = None
            if isinstance(op, dict) and "put" in op and (entry := _entry(op["put"])) is not None:
                self.entries[entry.name] = entry
            elif isinstance(op, dict) and isinstance(op.get("del"), str):
                self.entries.pop(op["del"], None)
            else:
                skipped += i < len(lines) - 1  # a torn last line is a crash mid-append
                continue
            self.journal_lines += 1
        if skipped:
            log.warning("disk: %d entries of the workspace catalog (%s) could not be read and "
                        "were left out: those trees are not evicted until a job uses them "
                        "again", skipped, self.dir)

    def _append(self, op: dict) -> None:
        """Journal one change. After a write that failed, the next change writes the whole
        snapshot instead (the journal may have lost a line, or hold a torn one)."""
        if self.save_error is not None:
            self.save()
            return
        line = (json.dumps(op, sort_keys=True, separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:  # one write(2) of a whole line: a crash leaves at most a torn last line
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            self._failed(exc)
            return
        self.journal_lines += 1
        if self.journal_lines > max(COMPACT_MIN, len(self.entries)):
            self.save()

    def _failed(self, exc: OSError) -> None:
        """A write of the catalog failed (the state file system full, a file in the way):
        the entries stay in memory, logged once per reason and shown in health, and the
        next change or stop tries the whole snapshot. Never raised into the disk actor:
        before stop 55 such a write crashed it at a job's end, at a maintenance pass or at
        its stop."""
        why = (f"the workspace catalog in {self.dir} cannot be written ({exc.strerror or exc}): "
               "it is kept in memory and written when it can be")
        if why != self.save_error:
            log.warning("disk: %s", why)
        self.save_error = why

    def _put(self, entry: Entry) -> None:
        self._append({"put": vars(entry)})  # (asdict's deep copy is 5x slower)

    def save(self) -> None:
        """Write the snapshot, then empty the journal (compaction); a failure is `_failed`'s."""
        tmp = self.path.with_name(f"catalog.json.{uuid.uuid4().hex[:8]}")
        body = json.dumps({"workspaces": [vars(e) for e in self.entries.values()]},
                          sort_keys=True, separators=(",", ":"))
        try:
            with open(tmp, "w") as f:  # no fsync: a lost entry after a crash only means a
                f.write(body)          # tree that is never evicted, the safe direction
            os.replace(tmp, self.path)
            with open(self.journal_path, "w"):
                pass  # emptied only after the snapshot holds everything it said
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._failed(exc)
            return
        if self.save_error is not None:
            log.warning("disk: the workspace catalog in %s is written again", self.dir)
            self.save_error = None
        self.journal_lines = 0
        self.compactions += 1

    def close(self) -> None:
        """Compact if anything is journalled (an orderly stop)."""
        if self.journal_lines:
            self.save()

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
            self.added.append(name)
            if len(self.added) > MAX_ADDED:  # nobody takes them: resolve everything again
                self.added.clear()
                self.generation += 1
        else:
            changed = (entry.path, entry.root, entry.kind) != (path, root, kind) or (
                caller_path is not None and caller_path != entry.caller_path)
            if (entry.path, entry.root) != (path, root):
                self.generation += 1
            entry.path, entry.root, entry.kind = path, root, kind
            entry.caller_path = caller_path or entry.caller_path
            entry.last_used_ms = max(entry.last_used_ms, now_ms)
            if not changed:  # last use is saved when the job goes idle (JobIdle)
                return entry
        self._put(entry)
        return entry

    def set_references(self, name: str, referenced_by: list[str]) -> None:
        entry = self.entries.get(name)
        if entry is not None and entry.referenced_by != referenced_by:
            entry.referenced_by = list(referenced_by)
            self._put(entry)

    def take_added(self) -> list[str]:
        """The names catalogued since the last call."""
        added, self.added = self.added, []
        return added

    def touch(self, name: str, now_ms: int) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.last_used_ms = max(entry.last_used_ms, now_ms)
            self._put(entry)

    def forget(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self.generation += 1
            self._append({"del": name})
