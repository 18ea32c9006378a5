"""Real trees: the deleter, the size walk, Cargo units and bundle unpacking."""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from motor.disk import bundles, cargo, sizes, trash
from motor.disk.bundles import BundleError, BundleStore, unpack_into
from tmpfs_helpers import Filler, tmpfs, tmpfs_unavailable

IS_ROOT = os.geteuid() == 0


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _umount_under(base: Path) -> None:
    for m in sorted(sizes.mounts_under(os.path.realpath(base)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    yield r
    _umount_under(tmp_path)


def test_symlink_pointing_outside_survives_eviction(root, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    ws = root / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "f").write_text("x")
    (ws / "link").symlink_to(outside)
    (ws / "sub" / "filelink").symlink_to(outside / "keep.txt")
    left = trash.delete_tree(str(ws), str(root))
    assert left == 0
    assert not ws.exists()
    assert (outside / "keep.txt").read_text() == "keep"
    assert os.listdir(root / trash.TRASH) == []


def test_evicting_a_symlinked_workspace_removes_only_the_link(root, tmp_path):
    outside = tmp_path / "target-dir"
    outside.mkdir()
    (outside / "a").write_text("a")
    (root / "alias").symlink_to(outside)
    trash.delete_tree(str(root / "alias"), str(root))
    assert (outside / "a").exists()


@pytest.mark.skipif(not IS_ROOT, reason="bind mounts need root")
def test_bind_mount_inside_a_workspace_is_not_crossed(root, tmp_path):
    src = tmp_path / "mounted-src"
    src.mkdir()
    (src / "data").write_text("do not delete")
    ws = root / "ws"
    (ws / "mnt").mkdir(parents=True)
    (ws / "own").write_text("x")
    if not _mount("--bind", str(src), str(ws / "mnt")):
        pytest.skip("mount --bind not permitted here")
    assert str(ws / "mnt") in sizes.mount_points()
    # the walk does not count it
    m = sizes.measure(str(ws))
    assert m.complete
    left = trash.delete_tree(str(ws), str(root))
    assert left >= 1  # the mount point stays in the trash
    assert (src / "data").read_text() == "do not delete"
    _umount_under(tmp_path)
    assert trash.collect_trash(str(root)) == 0
    assert (src / "data").exists()


@pytest.mark.skipif(not IS_ROOT, reason="tmpfs needs root")
def test_other_filesystem_inside_a_workspace_is_not_crossed(root, tmp_path):
    ws = root / "ws"
    (ws / "fs").mkdir(parents=True)
    if not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ws / "fs")):
        pytest.skip("tmpfs mount not permitted here")
    (ws / "fs" / "inside").write_text("other fs")
    mounts = frozenset()  # st_dev alone must stop it
    dest = trash.move_to_trash(str(ws), str(root))
    assert trash.purge(dest, mounts=mounts) >= 1
    assert (Path(dest) / "fs" / "inside").read_text() == "other fs"


def test_measure_counts_allocated_bytes_once_and_splits_target(root):
    ws = root / "ws"
    inc = ws / "target" / "debug" / "incremental" / "foo-abc"
    inc.mkdir(parents=True)
    (inc / "q").write_bytes(b"i" * 20000)
    (ws / "target" / "debug" / "bin").write_bytes(b"b" * 50000)
    (ws / "src.rs").write_bytes(b"s" * 10000)
    os.link(ws / "src.rs", ws / "hard.rs")
    (ws / "sym").symlink_to("/usr")
    m = sizes.measure(str(ws))
    du = int(subprocess.run(["du", "-s", "--block-size=1", str(ws)], capture_output=True,
                            text=True).stdout.split()[0])
    assert m.allocated_bytes == du
    assert m.complete
    assert 50000 + 20000 <= m.target_bytes < m.allocated_bytes
    assert 20000 <= m.incremental_bytes < m.target_bytes


WALKS = [pytest.param(False, id="os.stat")] + (  # see test_walk_reference.FAST
    [pytest.param(True, id="native")] if platform.machine() in sizes._LAYOUTS else [])


@pytest.mark.parametrize("fast", WALKS)
def test_unreadable_subtree_marks_incomplete_with_one_warning(root, monkeypatch, caplog, fast):
    ws = root / "ws"
    for d in ("a", "b", "c"):
        (ws / d).mkdir(parents=True)
        (ws / d / "f").write_bytes(b"x" * 5000)
    real = os.listdir

    def listdir(path="."):  # as root, permissions do not stop a read: fail it here
        if isinstance(path, bytes) and os.path.basename(path.rstrip(b"/")) in (b"a", b"b"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(sizes.os, "listdir", listdir)
    with caplog.at_level("WARNING", logger="motor.disk"):
        m = sizes.measure(str(ws), fast=fast)
    assert not m.complete and m.unreadable == 2
    warnings = [r.getMessage() for r in caplog.records if "incomplete" in r.message]
    assert len(warnings) == 1 and "Permission denied" in warnings[0]
    # what could be read is counted: c's file and the four directories
    monkeypatch.setattr(sizes.os, "listdir", real)
    readable = sum(os.lstat(p).st_blocks * 512 for p in (ws, ws / "a", ws / "b", ws / "c",
                                                          ws / "c" / "f"))
    assert m.allocated_bytes == readable


@pytest.mark.parametrize("fast", WALKS)
def test_an_entry_that_vanishes_between_listing_and_stat_is_unreadable(root, monkeypatch, fast):
    """The listing names a file the directory no longer has (a concurrent delete)."""
    ws = root / "ws"
    ws.mkdir()
    for i in range(3):
        (ws / f"f{i}").write_bytes(b"x" * 5000)
    real = os.listdir

    def listdir(path="."):
        names = real(path)
        return [*names, b"gone"] if isinstance(path, bytes) else names

    monkeypatch.setattr(sizes.os, "listdir", listdir)
    m = sizes.measure(str(ws), fast=fast)
    monkeypatch.setattr(sizes.os, "listdir", real)
    assert (m.complete, m.unreadable) == (False, 1)
    assert m.allocated_bytes == sum(os.lstat(p).st_blocks * 512
                                    for p in (ws, *(ws / f"f{i}" for i in range(3))))


@pytest.mark.skipif(not IS_ROOT, reason="mounts need root")
@pytest.mark.parametrize("fast", WALKS)
def test_the_walk_counts_neither_another_filesystem_nor_a_bind_mount(root, tmp_path, fast):
    ws = root / "ws"
    (ws / "fs").mkdir(parents=True)
    (ws / "bind").mkdir()
    (ws / "own").write_bytes(b"o" * 9000)
    src = tmp_path / "bound"
    (src / "sub").mkdir(parents=True)
    (src / "data").write_bytes(b"d" * 50_000)
    if not (_mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ws / "fs"))
            and _mount("--bind", str(src), str(ws / "bind"))):
        pytest.skip("mounts not permitted here")
    (ws / "fs" / "inside").write_bytes(b"i" * 100_000)
    # another filesystem: st_dev alone stops it (no mount list); the bind mount of the same
    # filesystem: the mount list does. Neither mount point nor what is under it counts.
    m = sizes.measure(str(ws), mounts=frozenset({str(ws / "bind")}), fast=fast)
    assert m.complete
    assert m.allocated_bytes == (os.lstat(ws).st_blocks + os.lstat(ws / "own").st_blocks) * 512


# --- Cargo units -----------------------------------------------------------------------------

H1, H2, H3 = "0123456789abcdef", "fedcba9876543210", "00112233aabbccdd"


def make_target(ws: Path, *, old_ms: int) -> None:
    prof = ws / "target" / "debug"
    for sub in ("deps", "build", ".fingerprint", "incremental"):
        (prof / sub).mkdir(parents=True, exist_ok=True)
    files = [f"libserde-{H1}.rlib", f"libserde-{H1}.rmeta", f"serde-{H1}.d",
             f"mytool-{H2}", f"mytool-{H2}.d", "README-not-a-unit", f"libfresh-{H3}.rlib"]
    for f in files:
        (prof / "deps" / f).write_bytes(b"x" * 5000)
    (prof / "build" / f"serde-{H1}").mkdir(exist_ok=True)
    (prof / "build" / f"serde-{H1}" / "build-script-build").write_bytes(b"s" * 3000)
    (prof / "build" / f"serde-{H1}" / "out").mkdir(exist_ok=True)
    (prof / "build" / f"serde-{H1}" / "out" / "gen.rs").write_bytes(b"g" * 100)
    (prof / ".fingerprint" / f"serde-{H1}").mkdir(exist_ok=True)
    (prof / ".fingerprint" / f"serde-{H1}" / "lib-serde").write_text("fp")
    (prof / "incremental" / f"serde-{H1}").mkdir(exist_ok=True)
    (prof / "incremental" / f"serde-{H1}" / "s-1").write_bytes(b"i" * 4000)
    # a symlink with a unit's name: never followed, never counted, never deleted
    if not (prof / "deps" / f"libevil-{H2}.rlib").is_symlink():
        (prof / "deps" / f"libevil-{H2}.rlib").symlink_to("/etc/hostname")
        (prof / "build" / f"evil-{H2}").symlink_to("/etc")
    for p in (prof).rglob("*"):
        if not p.is_symlink():
            os.utime(p, ns=(old_ms * 1_000_000, old_ms * 1_000_000))
    fresh = prof / "deps" / f"libfresh-{H3}.rlib"
    now = time.time_ns()
    os.utime(fresh, ns=(now, now))


def test_cargo_units_group_hashes_outputs_and_scripts_without_following_symlinks(tmp_path):
    ws = tmp_path / "ws"
    now_ms = time.time_ns() // 1_000_000
    make_target(ws, old_ms=now_ms - 72 * 3600 * 1000)
    units, incs = cargo.scan(str(ws))
    keys = {(u.name, u.hash): u for u in units}
    assert set(keys) == {("serde", H1), ("mytool", H2), ("fresh", H3)}
    serde = keys[("serde", H1)]
    assert sorted(os.path.basename(f) for f in serde.files) == sorted(
        [f"libserde-{H1}.rlib", f"libserde-{H1}.rmeta", f"serde-{H1}.d"])
    assert sorted(os.path.basename(os.path.dirname(d)) for d in serde.dirs) == ["." + "fingerprint", "build"]
    assert [os.path.basename(i.path) for i in incs] == [f"serde-{H1}"]
    stale = cargo.stale_units(units, now_ms)
    assert {(u.name, u.hash) for u in stale} == {("serde", H1), ("mytool", H2)}
    cargo.delete_units(stale, str(tmp_path))
    deps = sorted(os.listdir(ws / "target" / "debug" / "deps"))
    assert deps == sorted(["README-not-a-unit", f"libfresh-{H3}.rlib", f"libevil-{H2}.rlib"])
    assert (ws / "target" / "debug" / "build" / f"evil-{H2}").is_symlink()
    assert Path("/etc/hostname").exists()
    # incremental dirs are aged on their own, not as unit outputs
    assert (ws / "target" / "debug" / "incremental" / f"serde-{H1}").exists()


# --- bundles -------------------------------------------------------------------------------


def tar_bytes(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def reg(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


@pytest.mark.parametrize("members,why", [
    ([reg("ok.txt"), reg("../escape.txt")], "leaves"),
    ([reg("/etc/motor-evil")], "absolute"),
    ([reg("a/../../b")], "leaves"),
    ([link("up", "../../outside")], "outside"),
    ([link("abs", "/etc/passwd")], "absolute"),
    ([link("hl", "../x", tarfile.LNKTYPE)], "outside"),
    ([link("dir", "sub/../.."), reg("dir/x")], "outside"),
    # lexically inside, but s2 is the root, so s2/.. is its parent (issue 10)
    ([link("s1", "s2/.."), link("s2", ".")], "outside"),
    ([link("a", "."), link("b", "a/a/a/..")], "outside"),
    ([link("in", "d"), link("d", "e/.."), link("e", "."), reg("f")], "outside"),
    ([link("loop1", "loop2/x"), link("loop2", "loop1/x")], "loop"),
    # a member named through a symlink member (d -> .): tar never makes one from a tree
    ([link("d", "."), reg("d/x")], "through the symlink"),
    ([link("s", "."), link("h", "s/../x", tarfile.LNKTYPE)], "outside"),
])
def test_unsafe_bundle_is_refused_and_leaves_nothing(root, tmp_path, members, why):
    bundle = tmp_path / "b.tar"
    bundle.write_bytes(tar_bytes(members))
    ws = root / "ws"
    ws.mkdir()
    (ws / "existing").write_text("kept")
    with pytest.raises(BundleError, match=why):
        unpack_into(bundle, str(ws), str(root))
    assert os.listdir(ws) == ["existing"]
    assert os.listdir(root / bundles.STAGING) == []
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "outside").exists()


def test_tar_bundle_unpacks_as_the_workspace_source(root, tmp_path):
    bundle = tmp_path / "b.tar"
    bundle.write_bytes(tar_bytes([reg("src/main.rs", b"fn main(){}"), reg("Cargo.toml", b"[x]"),
                                  link("src/alias.rs", "main.rs")]))
    ws = root / "ws"
    (ws / "target").mkdir(parents=True)
    (ws / "src").mkdir()
    (ws / "src" / "old.rs").write_text("old")
    assert unpack_into(bundle, str(ws), str(root)) == 2
    assert (ws / "src" / "main.rs").read_text() == "fn main(){}"
    assert not (ws / "src" / "old.rs").exists()  # the bundle's entry replaces the old one
    assert (ws / "target").is_dir()  # what the bundle does not name stays
    assert os.listdir(root / bundles.STAGING) == []


def test_git_bundle_is_cloned(root, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, env=env, check=True, capture_output=True)
    run("init", "-q")
    (repo / "hello.txt").write_text("hi")
    run("add", ".")
    run("commit", "-qm", "one")
    run("bundle", "create", str(tmp_path / "src.bundle"), "--all")
    ws = root / "ws"
    ws.mkdir()
    unpack_into(tmp_path / "src.bundle", str(ws), str(root))
    assert (ws / "hello.txt").read_text() == "hi"
    assert (ws / ".git").is_dir()


def test_upload_digest_mismatch_leaves_nothing(tmp_path):
    import hashlib

    store = BundleStore(tmp_path)
    data = b"hello bundle"
    sha = hashlib.sha256(data).hexdigest()
    up = store.begin(sha)
    up.write(b"not the same")
    with pytest.raises(BundleError, match="mismatch"):
        up.commit(0)
    assert sorted(os.listdir(store.dir)) == []
    assert store.transfers == {}
    up = store.begin(sha)
    up.write(data)
    assert up.commit(5) == len(data)
    assert store.has(sha) and store.pins[sha] == 5
    assert set(os.listdir(store.dir)) == {"pins.json", sha}


def test_pins_that_cannot_be_saved_are_kept_in_memory_said_and_saved_again_later(tmp_path, caplog):
    """A save of the bundles' retention clocks that fails (here a directory where pins.json
    goes; the state file system full does the same) never fails the use that asked for it:
    the clocks stay in memory, the store says why (`save_error`, logged once), and the first
    save that works again clears it. A directory among the bundles is never removed as one."""
    store = BundleStore(tmp_path)
    sha, stray = "a" * 64, "b" * 64
    (store.dir / sha).write_bytes(b"bundle")
    (store.dir / stray).mkdir()  # not a bundle: `has` reads only files
    store.pins_path.mkdir()
    with caplog.at_level("WARNING", logger="motor.disk"):
        assert store.use(sha, 5) == store.path(sha)
        assert store.expire(10**12, ()) == [sha]  # unpinned and old: removed
        assert store.pins == {} and (store.dir / stray).is_dir()
    assert store.save_error is not None and "pins.json cannot be saved" in store.save_error
    assert [r.getMessage() for r in caplog.records].count("disk: " + store.save_error) == 1
    assert set(os.listdir(store.dir)) == {"pins.json", stray}  # no partial save left
    store.pins_path.rmdir()
    store.touch(sha, 7)
    assert store.save_error is None and json.loads(store.pins_path.read_text()) == {sha: 7}


def test_staging_sweep_removes_leftovers_but_never_an_unpack_in_progress(root, tmp_path, monkeypatch):
    import threading

    from polling import wait_for

    bundle = tmp_path / "b.tar"
    bundle.write_bytes(tar_bytes([reg("hello.txt", b"hi")]))
    ws = root / "ws"
    ws.mkdir()
    staging = root / bundles.STAGING
    (staging / "01old.leftover" / "src" / "deep").mkdir(parents=True)  # a killed runner's
    (staging / "01old.leftover" / "src" / "deep" / "f").write_text("x")
    (staging / "01old.leftover" / "out").symlink_to(tmp_path)  # never followed
    gate = tmp_path / "gate"
    monkeypatch.setenv("MOTOR_FAULTS", f"unpack.extracted=wait:{gate}")
    result = []
    worker = threading.Thread(target=lambda: result.append(
        unpack_into(bundle, str(ws), str(root), "job1")))
    worker.start()
    try:
        wait_for(lambda: os.path.exists(f"{gate}.reached"), what="the unpack to be extracted")
        assert bundles.sweep_staging(str(root)) == (1, 0)
        (live,) = os.listdir(staging)  # the unpack in progress stays, with its contents
        assert live.startswith("job1.") and (staging / live / "src" / "hello.txt").exists()
        assert (tmp_path / "b.tar").exists() and gate.parent.is_dir()
    finally:
        gate.write_text("")
        worker.join(30)
    assert result == [1] and (ws / "hello.txt").read_bytes() == b"hi"
    assert os.listdir(staging) == []
    assert bundles.sweep_staging(str(tmp_path / "no-such-root")) == (0, 0)


@pytest.mark.parametrize("links", [
    {"up": "../.."},
    {"abs": "/etc/passwd"},
    {"s1": "s2/..", "s2": "."},
])
def test_git_bundle_with_a_symlink_out_is_refused_and_leaves_nothing(root, tmp_path, links):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, env=env, check=True, capture_output=True)
    run("init", "-q")
    (repo / "hello.txt").write_text("hi")
    for name, target in links.items():
        (repo / name).symlink_to(target)
    run("add", ".")
    run("commit", "-qm", "one")
    run("bundle", "create", str(tmp_path / "src.bundle"), "--all")
    ws = root / "ws"
    ws.mkdir()
    with pytest.raises(BundleError, match="symlink"):
        unpack_into(tmp_path / "src.bundle", str(ws), str(root))
    assert os.listdir(ws) == []
    assert os.listdir(root / bundles.STAGING) == []


@pytest.mark.skipif(tmpfs_unavailable() is not None, reason=tmpfs_unavailable() or "")
def test_a_tree_on_a_file_system_with_no_inode_left_is_deleted_in_place(tmp_path, caplog):
    """The trash directory needs an inode; before stop 57 an eviction on a file system out of
    inodes failed ENOSPC at its `mkdir`, so that file system could never be cleaned up."""
    with tmpfs(tmp_path / "ws", size="16m", nr_inodes=200) as root:
        tree = root / "big"
        tree.mkdir()
        (tree / "sub").mkdir()
        (tree / "sub" / "f").write_text("x")
        Filler(root).inodes()
        assert not (root / trash.TRASH).exists()
        dest = trash.move_to_trash(str(tree), str(root))
        assert os.path.dirname(dest) == str(root)
        assert os.path.basename(dest).startswith(trash.TRASH + "-big.")
        assert "deleting" in caplog.text and not tree.exists()
        assert trash.beside_trash(str(root)) == [dest]
        assert trash.collect_trash(str(root)) == 0  # what a purge left, a later pass collects
        assert not os.path.exists(dest)
        again = root / "again"
        again.mkdir()  # one inode back from the purge
        assert trash.delete_tree(str(again), str(root)) == 0 and not again.exists()


def _deep_tree(top: Path, depth: int) -> None:
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            os.close(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def test_a_tree_deeper_than_recursion_and_fds_allow_is_deleted(root):
    """3,000 levels (paths far past PATH_MAX): before stop 57 the purge recursed once per
    level with a directory fd each, raised RecursionError and left the tree in the trash
    (and the disk actor, whose cleanup it was, crashed). Now what lies below MAX_DEPTH is
    moved up into the trash and deleted from there."""
    _deep_tree(root / "ws", 3000)
    assert trash.delete_tree(str(root / "ws"), str(root)) == 0
    assert os.listdir(root) == [trash.TRASH] and os.listdir(root / trash.TRASH) == []
    # what a purge cut short leaves (moved up, not yet deleted) is collected later
    _deep_tree(root / "again", 2 * trash.MAX_DEPTH)
    moved = trash.move_to_trash(str(root / "again"), str(root))
    os.rename(moved, root / trash.TRASH / "left")
    assert trash.collect_trash(str(root)) == 0 and os.listdir(root / trash.TRASH) == []
