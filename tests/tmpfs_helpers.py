"""A tiny real tmpfs for disk-full tests (`mount -t tmpfs`), and ways to fill it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def tmpfs_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "no mount(8)"
    return None


needs_tmpfs = pytest.mark.skipif(tmpfs_unavailable() is not None,
                                 reason=tmpfs_unavailable() or "")


@contextmanager
def tmpfs(path: Path, *, size: str = "32m", nr_inodes: int | None = None):
    """Mount a tmpfs at `path` for the block; always unmounted (lazily) afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Filler:
    """Fills a filesystem (no free inodes, no free blocks) and frees it again."""

    def __init__(self, root: Path):
        self.dir = root / ".filler"
        self.dir.mkdir(exist_ok=True)
        self.count = 0

    def inodes(self) -> int:
        """Create empty files until the filesystem has no inode left; how many were made."""
        made = 0
        while True:
            try:
                os.close(os.open(self.dir / f"i{self.count}", os.O_CREAT | os.O_WRONLY, 0o600))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return made
            self.count += 1
            made += 1

    def blocks(self) -> None:
        """Write one file until the filesystem has no block left."""
        chunk = b"\0" * 65536
        fd = os.open(self.dir / "blocks", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    os.write(fd, chunk if len(chunk) > 4096 else chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    if len(chunk) == 1:
                        return
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)

    def free(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def ext4_unavailable() -> str | None:
    """Why a small ext4 image cannot be loop-mounted here (None: it can)."""
    if os.geteuid() != 0:
        return "loop-mounting an ext4 image needs root"
    for tool in ("mount", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"no {tool}(8)"
    return None


needs_ext4 = pytest.mark.skipif(ext4_unavailable() is not None,
                                reason=ext4_unavailable() or "")


@contextmanager
def ext4(path: Path, *, journal: bool, size_mb: int = 16, options: str = ""):
    """A real ext4 file system (with or without a journal) in an image file, loop-mounted at
    `path` (with mount `options` besides `loop`) for the block; unmounted (lazily)
    afterwards. Skips the test when the mount is refused (no loop device in this
    container)."""
    path.mkdir(parents=True, exist_ok=True)
    image = path.with_name(path.name + ".img")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", *([] if journal else ["-O", "^has_journal"]),
                    str(image)], check=True, capture_output=True)
    mounted = subprocess.run(["mount", "-o", ",".join(filter(None, ("loop", options))),
                              str(image), str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        image.unlink(missing_ok=True)


def ext4_error(path: Path) -> None:
    """Make the ext4 file system mounted at `path` record an error, as a failing disk would
    (`/sys/fs/ext4/<device>/trigger_fs_error`): mounted with `errors=remount-ro`, it is
    read-only from then on (until it is unmounted and checked). Skips the test when this
    kernel has no such file."""
    source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True,
                            text=True, check=True).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(source).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip(f"this kernel cannot inject an ext4 error ({trigger} is missing)")
    trigger.write_text("1")
