"""The fast size walk against a straightforward one (path-based `lstat`, every entry's
relative path kept) on random trees: Cargo-like target/ and incremental dirs at various
depths, hard links, symlinks to directories and files."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from hypothesis import given, settings, strategies as st

from motor.disk import sizes

PARTS = ["target", "debug", "incremental", "x86_64", "src", "a"]


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
        m = sizes.measure(root)
        assert m.complete
        assert (m.allocated_bytes, m.target_bytes, m.incremental_bytes) == reference(root)
    finally:
        shutil.rmtree(root)
