"""The fast size walks against a straightforward one (path-based `lstat`, every entry's
relative path kept) on random trees: Cargo-like target/ and incremental dirs at various
depths, hard links, symlinks to directories and files; and on a tree with large directories
(more names than the native walk's first buffer holds)."""

from __future__ import annotations

import os
import platform
import shutil
import stat
import tempfile
import threading

import pytest
from hypothesis import given, settings, strategies as st

from motor.disk import sizes

PARTS = ["target", "debug", "incremental", "x86_64", "src", "a"]
#: both walks: `os.stat` per entry, and the ctypes `fstatat` a directory at a time wherever
#: motor knows the machine's `struct stat` (there `measure(fast=True)` raises if the native
#: walk was found unusable, so a broken one cannot hide behind the fallback)
FAST = [False] + ([True] if platform.machine() in sizes._LAYOUTS else [])


def reference(path: str) -> tuple[int, int, int]:
    seen, total, target, inc = set(), 0, 0, 0
    top = os.lstat(path)
    total += top.st_blocks * 512
    stack = [(path, (), False, False)]
    while stack:
        d, rel, in_t, in_i = stack.pop()
        for name in os.listdir(d):
            p = os.path.join(d, name)
            st_ = os.lstat(p)
            is_dir = stat.S_ISDIR(st_.st_mode)
            if not is_dir and st_.st_nlink > 1:
                if (st_.st_dev, st_.st_ino) in seen:
                    continue
                seen.add((st_.st_dev, st_.st_ino))
            r = rel + (name,)
            size = st_.st_blocks * 512
            t = in_t or (len(r) == 1 and name == "target" and is_dir)
            i = in_i or (is_dir and len(r) in (3, 4) and r[0] == "target"
                         and r[-1] == "incremental")
            total += size
            target += size if t else 0
            inc += size if i else 0
            if is_dir:
                stack.append((p, r, t, i))
    return total, target, inc


trees = st.lists(st.tuples(st.lists(st.sampled_from(PARTS), min_size=1, max_size=5),
                           st.sampled_from(["file", "dir", "link", "hard", "symdir"]),
                           st.integers(min_value=0, max_value=20000)),
                 min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(spec=trees)
def test_the_walk_equals_a_straightforward_walk(spec):
    root = tempfile.mkdtemp(prefix="motor-walk-ref-")
    try:
        files = []
        for parts, kind, size in spec:
            p = os.path.join(root, *parts)
            if any(os.path.islink(os.path.join(root, *parts[:i])) for i in range(1, len(parts))):
                continue  # never write through a symlink: "link" points at /usr/lib
            try:
                if kind == "dir":
                    os.makedirs(p, exist_ok=True)
                    continue
                os.makedirs(os.path.dirname(p), exist_ok=True)
                if os.path.lexists(p):
                    continue
                if kind == "file" or (kind == "hard" and not files):
                    with open(p, "wb") as f:
                        f.write(b"x" * size)
                    files.append(p)
                elif kind == "hard":
                    os.link(files[size % len(files)], p)
                elif kind == "link":
                    os.symlink("/usr/lib", p)
                else:
                    os.symlink(os.path.dirname(p), p)
            except (FileExistsError, NotADirectoryError):
                continue  # a file where the spec wants a directory
        want = reference(root)
        for fast in FAST:
            m = sizes.measure(root, fast=fast)
            assert m.complete
            assert (m.allocated_bytes, m.target_bytes, m.incremental_bytes) == want, fast
    finally:
        shutil.rmtree(root)


def test_large_directories_and_hard_links_in_them_equal_the_reference(monkeypatch):
    monkeypatch.setattr(sizes, "_per_thread", threading.local())  # fresh: 1024 slots first
    root = tempfile.mkdtemp(prefix="motor-walk-ref-")
    try:
        big = os.path.join(root, "target", "debug", "deps")
        os.makedirs(big)
        for i in range(1500):  # more than the 1024 slots the native walk starts with
            with open(os.path.join(big, f"f{i}"), "wb") as f:
                f.write(b"x" * (i % 9000))
        os.makedirs(os.path.join(root, "target", "debug", "incremental", "c-1"))
        os.link(os.path.join(big, "f7"), os.path.join(root, "target", "debug", "incremental",
                                                       "c-1", "h"))
        os.link(os.path.join(big, "f8"), os.path.join(root, "outside"))
        want = reference(root)
        assert want[1] > 0 and want[2] > 0
        for fast in FAST:
            m = sizes.measure(root, fast=fast)
            assert (m.allocated_bytes, m.target_bytes, m.incremental_bytes, m.complete) == (
                *want, True), fast
    finally:
        shutil.rmtree(root)


def test_a_wrong_stat_layout_is_caught_and_the_walk_falls_back_to_os_stat(monkeypatch, tmp_path):
    machine = platform.machine()
    if machine not in sizes._LAYOUTS:
        pytest.skip("no native walk on this machine (the os.stat walk is tested above)")
    size, fields = sizes._LAYOUTS[machine]
    wrong = dict(fields, blocks=(fields["blocks"][0] - 8, 8))  # st_blksize, not st_blocks
    monkeypatch.setitem(sizes._LAYOUTS, machine, (size, wrong))
    monkeypatch.setattr(sizes, "_native", False)  # check again
    assert sizes.native() is None
    (tmp_path / "f").write_bytes(b"x" * 10_000)
    m = sizes.measure(str(tmp_path))  # the os.stat walk
    assert m.allocated_bytes == reference(str(tmp_path))[0]
    try:
        sizes.measure(str(tmp_path), fast=True)
    except RuntimeError as exc:
        assert "no native fstatat" in str(exc)
    else:
        raise AssertionError("fast=True must not fall back silently")
