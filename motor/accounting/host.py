"""The accounting subsystem's small reads of the host: /proc samples and git pointers.

Kept apart from core.py (pure) so the parsers can be tested with fixture text, and
the reads can be pointed at a fake root.
"""

from __future__ import annotations

import os
from pathlib import Path

from .core import host_sample, main_checkout_from_gitdir, parse_cpuinfo, repository_name


def _read(path: Path, limit: int = 1 << 20) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


class HostSampler:
    """Samples load and available memory on each call; logical CPUs once (cpuinfo is big)."""

    def __init__(self, proc_root: str | os.PathLike = "/proc"):
        self.proc = Path(proc_root)
        cpuinfo = _read(self.proc / "cpuinfo")
        try:
            logical = parse_cpuinfo(cpuinfo) if cpuinfo else None
        except ValueError:
            logical = None
        self._logical = logical or os.cpu_count()

    def sample(self) -> dict | None:
        try:
            return host_sample(_read(self.proc / "loadavg"), None,
                               _read(self.proc / "meminfo"), self._logical)
        except Exception:  # a host sample is optional; never fail a probe for it
            return None


def resolve_repository(path: str | None) -> str:
    """The basename of the main checkout of the repository at `path` (see docs/accounting.md).

    When `path` exists on this host and is a linked worktree (its `.git` is a file
    `gitdir: <main>/.git/worktrees/<w>`), or is such a gitdir itself, the pointer is
    followed (through `commondir`) to the main checkout. Otherwise the path is read as text:
    `/x/app/.git/worktrees/w`, `/x/app/.git`, `/x/app.git` and `/x/app` all give `app`.
    """
    if not path:
        return repository_name(path)
    try:
        p = Path(path)
        dotgit = p / ".git"
        gitdir: Path | None = None
        if dotgit.is_file():
            text = _read(dotgit, 4096) or ""
            for line in text.splitlines():
                if line.startswith("gitdir:"):
                    target = Path(line[len("gitdir:"):].strip())
                    gitdir = target if target.is_absolute() else (p / target)
                    break
        elif (p / "commondir").is_file() and (p / "HEAD").exists():
            gitdir = p  # the path is a worktree's gitdir itself
        if gitdir is not None:
            commondir = _read(gitdir / "commondir", 4096)
            main = main_checkout_from_gitdir(os.path.abspath(gitdir), commondir)
            return repository_name(main)
    except OSError:
        pass
    return repository_name(path)


class RepositoryNames:
    """`resolve_repository` with a per-path cache (a rebuild sees each path many times)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.cache: dict[str | None, str] = {}

    def __call__(self, path: str | None) -> str:
        name = self.cache.get(path)
        if name is None:
            name = resolve_repository(path)
            if len(self.cache) >= self.limit:
                self.cache.clear()
            self.cache[path] = name
        return name
