"""Source bundles: streamed upload, digest check, pinning, and safe unpacking.

Store layout (`<state>/bundles/`):
- `<sha>.partial.<nonce>`  an upload in progress (one per transfer; removed on any failure);
- `<sha>`                  a verified bundle (renamed into place only after the digest matched);
- `pins.json`              {sha: last_used_ms}: the retention clock, which survives restarts.

A bundle is pinned while a live job names it, while a transfer of it is in progress, and for
24 hours after its last use (upload, or a job's setup); maintenance removes the rest.

Unpacking (`unpack_into`) happens in a fresh staging directory beside the workspace (same
filesystem), which is removed on any failure, so a refused bundle leaves nothing behind;
only when the whole archive is unpacked are its top-level entries moved into the workspace
(an existing entry of the same name is first moved to the trash, never followed).
A runner killed mid-unpack leaves its staging directory behind: `sweep_staging` removes
such leftovers when the disk actor starts.
A tar member is refused when its name is absolute or has a `..` component, when it is a
device or fifo, when it is named through a symlink member, when a hard link names a path
outside the archive root, or when a symlink is absolute or resolves outside the root
(resolved through the archive's own symlinks, component by component, as the kernel will);
extraction also runs under `tarfile.data_filter`.
A git bundle (`# v2 git bundle` / `# v3 git bundle`) is cloned with `git clone`, and the
checked-out tree's symlinks must pass the same rule (`check_tree_links`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import stat
import subprocess
import tarfile
import threading
import uuid
from pathlib import Path
from typing import Iterable

from .. import faults
from . import trash
from .core import BUNDLE_RETENTION_MS

log = logging.getLogger("motor.disk")

STAGING = ".motor-staging"


class BundleError(Exception):
    """A bundle that does not match its digest or cannot be unpacked safely."""


def valid_sha(sha: str) -> bool:
    return len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)


class BundleStore:
    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir) / "bundles"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.transfers: dict[str, int] = {}  # sha -> uploads in progress
        self.pins_path = self.dir / "pins.json"
        self.pins: dict[str, int] = self._load_pins()
        #: why the last save of the pins failed (None: it did not); health says it
        self.save_error: str | None = None

    # -- pins -------------------------------------------------------------------------

    def _load_pins(self) -> dict[str, int]:
        """The saved retention clocks. What is not {sha: milliseconds} is left out, and said:
        a bundle without a pin has its clock started at the next collection (never removed
        early). Before stop 49 one pin that was not a number (`null`, a list) stopped the
        disk actor at every start, and `serve` with it."""
        try:
            data = json.loads(self.pins_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("disk: %s cannot be read (%s): every stored bundle's retention "
                        "starts again", self.pins_path, exc)
            return {}
        if not isinstance(data, dict):
            data = {"(the whole file)": data}
        pins = {k: v for k, v in data.items() if valid_sha(k) and type(v) is int}
        if left := len(data) - len(pins):
            log.warning("disk: %s: %d entr%s not {sha256: milliseconds}, left out: their "
                        "retention starts again", self.pins_path, left, "y is" if left == 1 else "ies are")
        return pins

    def _save_pins(self) -> None:
        """Write the retention clocks. A save that fails (the state file system full,
        something not a file where pins.json goes) is logged once per reason and shown in
        health (`save_error`); the clocks stay in memory and the next save tries again.
        It never fails the use that asked for it: before stop 55 it raised into the disk
        actor, and a pins.json that could not be replaced crashed it at every maintenance
        pass until the runner stopped."""
        tmp = self.pins_path.with_name(f"pins.json.{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(json.dumps(self.pins, sort_keys=True))
            os.replace(tmp, self.pins_path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            why = (f"{self.pins_path} cannot be saved ({exc.strerror or exc}): the bundles' "
                   "retention clocks are kept in memory only, and start again at a restart")
            if why != self.save_error:
                log.warning("disk: %s", why)
            self.save_error = why
            return
        if self.save_error is not None:
            log.warning("disk: %s is saved again", self.pins_path)
            self.save_error = None

    def touch(self, sha: str, now_ms: int) -> None:
        """Record a use (upload, setup): the 24 h retention counts from the latest."""
        self.pins[sha] = max(now_ms, self.pins.get(sha, 0))
        self._save_pins()

    def path(self, sha: str) -> Path:
        return self.dir / sha

    def has(self, sha: str) -> bool:
        return valid_sha(sha) and self.path(sha).is_file()

    def use(self, sha: str, now_ms: int) -> Path | None:
        """A use of a stored bundle (a presence check at submit, a setup): its path, and
        its retention clock restarts; None when it is not stored."""
        if not self.has(sha):
            return None
        self.touch(sha, now_ms)
        return self.path(sha)

    # -- upload -----------------------------------------------------------------------

    def begin(self, sha: str) -> "Upload":
        if not valid_sha(sha):
            raise BundleError("a bundle is named by 64 lowercase hex digits of its sha256")
        self.transfers[sha] = self.transfers.get(sha, 0) + 1
        return Upload(self, sha)

    def _end_transfer(self, sha: str) -> None:
        n = self.transfers.get(sha, 0) - 1
        if n <= 0:
            self.transfers.pop(sha, None)
        else:
            self.transfers[sha] = n

    # -- retention --------------------------------------------------------------------

    def expire(self, now_ms: int, needed: Iterable[str]) -> list[str]:
        """Remove bundles that no job or transfer needs and whose last use is > 24 h old.
        Stale partial uploads (no transfer in progress) go too."""
        needed = set(needed) | set(self.transfers)
        removed = []
        with os.scandir(self.dir) as entries:  # closed even when a save below raises
            listed = list(entries)
        for entry in listed:
            name = entry.name
            if entry.is_dir(follow_symlinks=False):
                continue  # not a bundle, nor an upload (`has` reads only files): left alone
            if ".partial." in name:
                if name.split(".partial.")[0] not in self.transfers:
                    _unlink(entry.path)
                continue
            if not valid_sha(name):
                continue
            last = self.pins.get(name)
            if last is None:  # a bundle without a pin record (older state): start its clock
                self.pins[name] = last = now_ms
                self._save_pins()
            if name in needed or now_ms - last < BUNDLE_RETENTION_MS:
                continue
            _unlink(entry.path)
            self.pins.pop(name, None)
            removed.append(name)
        if removed:
            self._save_pins()
        return removed


class Upload:
    """One transfer: write chunks to a private partial file, hash them, then commit."""

    def __init__(self, store: BundleStore, sha: str):
        self.store, self.sha = store, sha
        self.partial = store.dir / f"{sha}.partial.{uuid.uuid4().hex[:12]}"
        self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.hash = hashlib.sha256()
        self.size = 0
        self.done = False

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.hash.update(chunk)
        self.size += len(chunk)

    def commit(self, now_ms: int) -> int:
        """Verify the digest and rename into place; BundleError (and nothing left) if not."""
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            got = self.hash.hexdigest()
            if got != self.sha:
                raise BundleError(f"bundle digest mismatch: the body's sha256 is {got}, "
                                  f"not {self.sha}")
            os.replace(self.partial, self.store.path(self.sha))
            self.store.touch(self.sha, now_ms)
            return self.size
        finally:
            self.abort()

    def commit_reply(self, now_ms: int) -> "int | BundleError | OSError":
        """`commit`, with a digest mismatch or an I/O error (a full disk) returned instead of
        raised: the disk actor hands it back for its caller to raise, and carries on."""
        try:
            return self.commit(now_ms)
        except (BundleError, OSError) as exc:
            return exc

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink(self.partial)
        self.store._end_transfer(self.sha)


def _unlink(path) -> None:
    """Remove a file of the store; one that cannot be removed is logged and left (a
    retention pass or a failed upload's clean-up never fails for it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("disk: %s cannot be removed (%s): left in place", path, exc)


# --- unpacking -------------------------------------------------------------------------


def is_git_bundle(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(20)
    return head.startswith(b"# v2 git bundle") or head.startswith(b"# v3 git bundle")


MAX_LINK_HOPS = 40  # like the kernel's ELOOP limit


def check_tar_members(tf: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Every member, or BundleError naming the first one that could escape the root.

    Link targets are resolved the way the kernel will resolve them once the archive is
    unpacked: through the archive's own symlinks, one component at a time (so `s1 -> s2/..`
    with `s2 -> .` is the root's parent, not `.`). A member named through a symlink member
    (`d -> x` and `d/f`) is refused: tar never writes one from a real tree."""
    members = tf.getmembers()
    links: dict[str, str] = {}
    for m in members:
        name = m.name
        if name.startswith("/") or name.startswith("\\") or (len(name) > 1 and name[1] == ":"):
            raise BundleError(f"bundle member {name!r} has an absolute name")
        norm = posixpath.normpath(name)
        if norm == ".." or norm.startswith("../") or ".." in name.split("/"):
            raise BundleError(f"bundle member {name!r} leaves the workspace")
        if m.ischr() or m.isblk() or m.isfifo() or not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise BundleError(f"bundle member {name!r} is not a file, directory or link")
        if m.issym():
            if m.linkname.startswith("/"):
                raise BundleError(f"bundle symlink {name!r} points to the absolute path {m.linkname!r}")
            links[norm] = m.linkname
        if m.islnk() and m.linkname.startswith("/"):
            raise BundleError(f"bundle hard link {name!r} points outside the workspace")
    for m in members:
        norm = posixpath.normpath(m.name)
        parts = norm.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in links:
                raise BundleError(f"bundle member {m.name!r} is named through the symlink "
                                  f"{prefix!r}")
        if m.issym():
            _resolve(parts[:-1], m.linkname, links, f"bundle symlink {m.name!r}")
        elif m.islnk():
            _resolve([], m.linkname, links, f"bundle hard link {m.name!r}")
    return members


def _resolve(base: list[str], target: str, links: dict[str, str], what: str) -> list[str]:
    """`target` (relative) resolved from the directory `base` through the archive's
    symlinks; BundleError if it leaves the root at any step or loops."""
    stack = list(base)
    todo = target.split("/")
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                raise BundleError(f"{what} points outside the workspace ({target!r})")
            stack.pop()
            continue
        here = "/".join(stack + [part])
        if here in links:
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise BundleError(f"{what} is a symlink loop ({target!r})")
            todo = links[here].split("/") + todo  # relative to the link's own directory
            continue
        stack.append(part)
    return stack


def _extract_tar(bundle: Path, dest: str) -> None:
    try:
        with tarfile.open(bundle, "r:*") as tf:
            check_tar_members(tf)
            tf.extractall(dest, filter="data")
    except tarfile.TarError as exc:
        raise BundleError(f"bundle is not a readable tar or git bundle: {exc}") from None


def _clone_git(bundle: Path, dest: str) -> None:
    git = shutil.which("git")
    if git is None:
        raise BundleError("a git bundle needs git on the runner host")
    proc = subprocess.run([git, "clone", "--quiet", str(bundle), dest],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if proc.returncode != 0:
        raise BundleError(f"git clone of the bundle failed: {proc.stderr.strip()[:300]}")
    check_tree_links(dest)


def check_tree_links(top: str) -> None:
    """The rule for tar symlinks, applied to a checked-out tree (a git clone can hold
    any symlink): absolute targets, or targets resolving outside `top` through the tree's
    own symlinks, refuse the bundle. Walks without following links."""
    links: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                links[os.path.relpath(path, top).replace(os.sep, "/")] = os.readlink(path)
    for name, target in sorted(links.items()):
        if target.startswith("/"):
            raise BundleError(f"bundle symlink {name!r} points to the absolute path {target!r}")
        _resolve(name.split("/")[:-1], target, links, f"bundle symlink {name!r}")


#: Staging directories this process is unpacking into right now (guarded by _active_lock).
#: Anything else under a `.motor-staging/` is a leftover of an earlier runner (a crash or a
#: kill -9 mid-unpack): `sweep_staging` removes those at start-up.
_active: set[str] = set()
_active_lock = threading.Lock()


def sweep_staging(root: str) -> tuple[int, int]:
    """Remove the leftovers in `root`'s staging directory (never an unpack in progress in
    this process; never following a symlink or crossing a mount, like every deletion).
    Returns (entries removed, entries that stay)."""
    staging_root = os.path.join(root, STAGING)
    try:
        names = os.listdir(staging_root)
    except FileNotFoundError:
        return 0, 0
    except OSError as exc:
        log.warning("disk: cannot list %s: %s", staging_root, exc)
        return 0, 1
    removed = left = 0
    for name in names:
        path = os.path.join(staging_root, name)
        with _active_lock:
            if path in _active:
                continue
        try:
            stuck = trash.purge(path)
        except (OSError, trash.UnsafeDelete) as exc:
            log.warning("disk: cannot remove the staging leftover %s: %s", path, exc)
            left += 1
            continue
        if stuck:
            left += 1
        else:
            removed += 1
    return removed, left


def unpack_into(bundle: Path, workspace: str, root: str, tag: str = "") -> int:
    """Unpack `bundle` as the source of `workspace` (a directory under `root`).

    Returns the number of top-level entries placed. On failure nothing is left behind."""
    staging_root = os.path.join(root, STAGING)
    os.makedirs(staging_root, mode=0o700, exist_ok=True)
    stage = os.path.join(staging_root, f"{tag}.{uuid.uuid4().hex}" if tag else uuid.uuid4().hex)
    with _active_lock:
        _active.add(stage)
    try:
        os.mkdir(stage, 0o700)
        return _unpack_staged(bundle, workspace, root, stage)
    finally:
        with _active_lock:
            _active.discard(stage)


def _unpack_staged(bundle: Path, workspace: str, root: str, stage: str) -> int:
    try:
        src = os.path.join(stage, "src")
        if is_git_bundle(bundle):
            _clone_git(bundle, src)
        else:
            os.mkdir(src, 0o755)
            _extract_tar(bundle, src)
        faults.hit("unpack.extracted")  # tests: a crash with the staging directory full
        ws_st = os.lstat(workspace)
        if not stat.S_ISDIR(ws_st.st_mode):
            raise BundleError(f"workspace {workspace} is not a directory")
        placed = 0
        for name in sorted(os.listdir(src)):
            dest = os.path.join(workspace, name)
            if os.path.lexists(dest):
                trash.delete_tree(dest, root)
            os.rename(os.path.join(src, name), dest)
            placed += 1
        return placed
    finally:
        try:
            trash.purge(stage)
        except OSError:
            shutil.rmtree(stage, ignore_errors=True)
