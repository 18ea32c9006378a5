"""Evicting a workspace never reaches through its links (embedded runner, MockClock).

A job leaves hard links to files outside its workspace (in the state dir, in another
workspace; also inside a read-only and an unsearchable directory) and symlinks pointing
out. Idle expiry then evicts the workspace through the disk actor: the other links' files
keep their content, mode, owner and mtime, only their link count drops, and nothing behind
a symlink is touched."""

from __future__ import annotations

import os

import trio

from motor.maintenance import RunPass
from motor.records import JobRequest

from runner_helpers import embedded_config, terminal_of

HOUR_S = 3600


def _facts(path):
    st = os.lstat(path)
    return path.read_bytes(), st.st_mode, st.st_uid, st.st_mtime_ns, st.st_ino


async def test_eviction_removes_hard_links_without_touching_the_other_names(
        tmp_path, autojump_clock):
    import motor

    config = embedded_config(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    precious = state / "precious.txt"
    precious.write_bytes(b"state file\n")
    precious.chmod(0o444)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("outside\n")
    async with motor.open_runner(config) as runner:
        keeper = await runner.submit(JobRequest(
            command=["sh", "-c", "printf 'other workspace\\n' > kept.txt"],
            workspace="keeper", workspace_kind="head"))
        assert (await terminal_of(runner, keeper.job_id))["state"] == "succeeded"
        kept = state / "workspaces" / "keeper" / "kept.txt"
        script = " && ".join([
            f"ln {precious} hard-state",
            "mkdir -p sub ro locked",
            f"ln {kept} sub/hard-other",
            f"ln {precious} ro/hard-ro",
            f"ln {kept} locked/hard-locked",
            "chmod 0555 ro && chmod 0 locked",
            f"ln -s {outside} link-dir",
            f"ln -s {precious} link-file",
            "printf 'own\\n' > own.txt",
        ])
        victim = await runner.submit(JobRequest(command=["sh", "-c", script], workspace="victim"))
        assert (await terminal_of(runner, victim.job_id))["state"] == "succeeded"
        ws = state / "workspaces" / "victim"
        assert os.lstat(precious).st_nlink == 3 and os.lstat(kept).st_nlink == 3
        before = {p: _facts(p) for p in (precious, kept, outside / "keep.txt")}

        await trio.sleep(25 * HOUR_S)  # past the 24 h idle expiry of a task workspace
        await runner.actor("maintenance").call(RunPass())

        assert not os.path.lexists(ws)
        assert (state / "workspaces" / "keeper").is_dir()  # a head survives idle expiry
        assert {p: _facts(p) for p in before} == before
        assert os.lstat(precious).st_nlink == 1 and os.lstat(kept).st_nlink == 1
        trash = state / "workspaces" / ".motor-trash"
        assert not trash.exists() or os.listdir(trash) == []
