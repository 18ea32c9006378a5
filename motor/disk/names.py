"""Workspace names to canonical host paths (moved from disk/actor.py, unchanged).

A workspace is named by a plain name (a directory under the first workspace root), by a
caller's absolute path mapped through `--caller-root CALLER=HOST`, or by its catalog entry.
Resolution reads the file system (`os.path.realpath`; one `lstat` for a plain name that
is not a symlink: `_resolved_under`); it is cheap and runs in the disk actor's event loop,
as before (a job names at most 256 siblings, `records.MAX_SIBLINGS`). `canon` memoizes a
name's path until the catalog's names or paths change (its generation) or `rescan()` is
called (each maintenance pass: symlinks may have changed on disk); without a live index
(the reference way) every call resolves again.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterable

from .core import under_root


class Names:
    def __init__(self, state_dir: Path, workspace_roots: Iterable[Path] = (),
                 caller_roots: dict[str, str] | None = None, *, memo: bool = True):
        roots = [Path(r) for r in workspace_roots] or [Path(state_dir) / "workspaces"]
        self.workspace_roots = [os.path.realpath(r) for r in roots]
        self.caller_roots = {c.rstrip("/"): os.path.realpath(h)
                             for c, h in (caller_roots or {}).items()}
        self.allowed_roots = tuple(dict.fromkeys(
            [*self.workspace_roots, *self.caller_roots.values()]))
        self.catalog: Any = None  # set by the actor once the catalog is open
        self.memo = memo
        self._memo: dict[str, str] = {}
        self._key: tuple = ()
        self.epoch = 0

    def key(self) -> tuple:
        """Changes whenever a memoized path may be stale."""
        return (self.catalog.generation if self.catalog else -1, self.epoch)

    def rescan(self) -> None:
        self.epoch += 1

    def take_added(self) -> list[str]:
        """Names catalogued since the last call: their path may differ from what they
        resolved to before (the live view re-resolves just those)."""
        return self.catalog.take_added() if self.catalog else []

    def workspace_path(self, name: str) -> tuple[str, str]:
        """(canonical host path, allowed root) of a workspace name or caller path."""
        entry = self.catalog.get(name) if self.catalog else None
        if entry is not None:
            return entry.path, entry.root
        host = self.host_path(name)
        if host is not None:
            return host
        root = self.workspace_roots[0]
        return _resolved_under(root, name), root

    def root_of(self, name: str) -> str:
        """`workspace_path(name)[1]` without resolving the path (the room check's question:
        which allowed root, so which file system)."""
        entry = self.catalog.get(name) if self.catalog else None
        if entry is not None:
            return entry.root
        if name.startswith("/"):
            for caller, host in self.caller_roots.items():
                if name == caller or name.startswith(caller + "/"):
                    return host
        return self.workspace_roots[0]

    def host_path(self, caller_path: str) -> tuple[str, str] | None:
        """A caller's path mapped through --caller-root to (host path, host root)."""
        if not caller_path.startswith("/"):
            return None
        for caller, host in self.caller_roots.items():
            if caller_path == caller or caller_path.startswith(caller + "/"):
                rest = caller_path[len(caller):].lstrip("/")
                return os.path.realpath(os.path.join(host, rest)), host
        return None

    def canon(self, name: str) -> str:
        """A name's canonical host path (memoized, see the module docstring)."""
        if not self.memo:  # the reference way: resolve on every check
            return self.workspace_path(name)[0]
        entry = self.catalog.get(name) if self.catalog else None
        if entry is not None:  # catalogued: its recorded path (as workspace_path), never stale
            return entry.path
        key = self.key()
        if key != self._key:
            self._memo.clear()
            self._key = key
        path = self._memo.get(name)
        if path is None:
            path = self._memo[name] = self.workspace_path(name)[0]
        return path

    def registered(self, path: str) -> tuple[str, str]:
        """(canonical path, allowed root) of a tree to catalog (`Register`); ValueError when
        it is not under an allowed root."""
        canonical = os.path.realpath(path)
        root = under_root(canonical, self.allowed_roots)
        if not root:
            raise ValueError(f"{path} is not under an allowed workspace root")
        return canonical, root

    def touched(self, workspace: str | None, siblings: Iterable[str]) -> frozenset[str]:
        """The names and canonical paths of a job's workspace and siblings."""
        names = [n for n in (workspace, *siblings) if n]
        return frozenset(names) | frozenset(self.canon(n) for n in names)


def _resolved_under(root: str, name: str) -> str:
    """`realpath(root/name)` for a canonical `root`: one `lstat` for a plain name (a single
    component, not `.` or `..`) that is not a symlink, where realpath takes one per
    component of the whole path (a job's siblings are each resolved at its admission:
    5,000 of them took 175 ms of the disk actor's loop, stop 59)."""
    path = os.path.join(root, name)
    if "/" in name or name in (".", ".."):
        return os.path.realpath(path)
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return path
    except FileNotFoundError:
        return path
    except OSError:
        pass
    return os.path.realpath(path)
