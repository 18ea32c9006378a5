"""A disk that stalls the store's commits, through a real `motor serve` (issue 14, stop 27;
docs/operations.md "When the disk is slow").

The fault point `store.commit` holds each commit at a file barrier (motor/faults.py), as a
disk whose writes wait on the kernel's write-back holds it. The first held commit runs on
the event loop; released after 150 ms, it held the loop past the budget (0.1 s within a
second), and the commits move to a worker thread:
while the next one is held there, the runner answers `GET /v1/health` at once (where the
commits run; after a second, degraded: the store, with the wait), and nothing it accepted
is lost. Real processes, the HTTP client on the
runner's socket.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from motor.client import Client
from motor.disk.catalog import Catalog
from motor.records import Terminal
from tests.polling import wait_for

pytestmark = pytest.mark.e2e


def submit_in_thread(serve, job: dict) -> tuple[threading.Thread, list]:
    answers: list = []

    def run():
        with Client(serve.socket, timeout=60) as client:
            answers.append(client.submit(job))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answers


def ended(serve, job_id: str) -> str:
    """The job's terminal state, once it ended."""
    with Client(serve.socket, timeout=60) as client, client.events(job_id) as stream:
        ends = [e for e in stream if isinstance(e, Terminal)]
    return ends[-1].record["state"]


def test_serve_answers_while_a_commit_waits_on_the_disk(serve_factory, tmp_path):
    gate = tmp_path / "gate"
    reached = tmp_path / "gate.reached"
    serve = serve_factory("--isolation", "none")
    serve.env = {"MOTOR_FAULTS": f"store.commit=wait:{gate}"}
    serve.start()
    try:
        held_commits(serve, gate, reached)
    finally:
        gate.touch()  # a failed check leaves no runner held at the barrier
    assert serve.stop() == 0


def held_commits(serve, gate, reached) -> None:

    # 1. the first commit (a submit's acceptance) is held on the event loop
    first, first_answer = submit_in_thread(serve, {"command": ["true"], "workspace": "a"})
    wait_for(reached.exists, timeout=30, what="the first commit to reach the barrier")
    time.sleep(0.15)  # it takes at least this long: it held the loop past the budget
    gate.touch()
    first.join(30)
    assert first_answer and first_answer[0].state in ("queued", "setup", "running", "succeeded")
    assert ended(serve, first_answer[0].job_id) == "succeeded"

    # 2. the barrier closed again, the runner idle: the next commit, the dispatcher's save
    #    of a submit, waits in a worker thread
    gate.unlink()
    reached.unlink()
    second, second_answer = submit_in_thread(serve, {"command": ["true"], "workspace": "b"})
    wait_for(reached.exists, timeout=30, what="a commit to reach the barrier again")
    with Client(serve.socket, timeout=5) as client:
        # the event loop answers while the commit is held, and so does the dispatcher's
        # capacity (its own save may be the one held: it is read, not queued behind it)
        health = client.health()
        assert health["store"]["commits_run_in"] == "thread", health["store"]
        assert health["store"]["slow_commits"] >= 1
        assert not [d for d in health["degraded"] if d["subsystem"] == "dispatcher"], health
        assert health["capacity"]["max_weight"] >= 1
        # held for a second: health says so (degraded, the store, with the wait)
        stalled = wait_for(lambda: [d for d in client.health()["degraded"]
                                    if d["subsystem"] == "store"], timeout=30,
                           what="health to report the stalled commit")
        assert "a commit has waited" in stalled[0]["cause"], stalled
        assert not second_answer  # its acceptance is still being committed
        assert client.health()["store"]["commit_waiting_ms"] >= 1000
        # the status and the job list are read too, not queued behind the held save (stop
        # 51; before, each waited for the commit: here past the client's 5 s)
        status = client.status()
        assert status["queued"] == [] and status["running"] == [] and "capacity" in status
        assert [j.job_id for j in client.jobs(all=True)] == [first_answer[0].job_id]
    gate.touch()
    second.join(30)
    assert second_answer and second_answer[0].job_id != first_answer[0].job_id

    assert ended(serve, second_answer[0].job_id) == "succeeded"
    with Client(serve.socket, timeout=30) as client:
        # the job's end is published once its record is saved; a later save may still be in
        # its thread for a few ms (CI saw 4.575): none is left waiting once the runner is idle
        health = wait_for(lambda: (h := client.health())["store"]["commit_waiting_ms"] == 0
                          and h, timeout=30, what="the runner's last commit to end")
        assert health["status"] == "ok", health["degraded"]
        store = health["store"]
        assert store["slow_commits"] >= 2 and store["commits_in_thread"] >= 1
        assert store["longest_commit_ms"] >= 150
        metrics = client.metrics()
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("motor_store_")}
    assert counts["motor_store_slow_commits_total"] >= 2
    assert counts["motor_store_commits_in_thread_total"] >= 1
    assert counts["motor_store_commits_off_loop"] in (0.0, 1.0)


def serve_with_gated_walks(serve_factory, tmp_path):
    """A started `motor serve` whose workspace walks wait at the fault point `disk.walk`
    for `gate` (there for now: walks pass until the test removes it), and say so in
    `gate.reached`: (serve, gate, reached)."""
    gate, reached = tmp_path / "gate", tmp_path / "gate.reached"
    gate.touch()
    serve = serve_factory("--isolation", "none")
    serve.env = {"MOTOR_FAULTS": f"disk.walk=wait:{gate}"}
    return serve.start(), gate, reached


def hold_the_guards_walk(serve, gate, reached) -> None:
    """A job's end in workspace `walked` whose guard walk waits at the closed barrier."""
    assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
    gate.unlink()
    reached.unlink(missing_ok=True)
    assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
    wait_for(reached.exists, timeout=30, what="the guard's walk to reach the barrier")


def test_serve_health_reads_the_free_space_while_the_disk_actor_waits_on_a_walk(
        serve_factory, tmp_path):
    """The disk actor's `Sample` is a reader (docs/actors.md): while the actor waits for a
    walk of a workspace (held at the fault point `disk.walk`, as a slow disk holds it),
    `GET /v1/health` still answers at once with the free space."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    try:
        gate.unlink()
        reached.unlink(missing_ok=True)
        with Client(serve.socket, timeout=30) as client:
            job = client.submit({"command": ["true"], "workspace": "walked"})
        wait_for(reached.exists, timeout=30, what="a walk to reach the barrier")
        with Client(serve.socket, timeout=5) as client:
            health = client.health()
        assert not [d for d in health["degraded"] if d["subsystem"] == "disk"], health
        assert health["disk"]["free_bytes"] > 0
    finally:
        gate.touch()
    assert ended(serve, job.job_id) == "succeeded"
    assert serve.stop() == 0


def test_serve_answers_other_jobs_while_the_guard_walks_a_workspace_a_job_left(
        serve_factory, tmp_path):
    """A job's end makes the build-folder guard walk its workspace (GUARD_DELAY_S later).
    That walk (held at `disk.walk`, as a huge tree or a file system that stopped answering
    holds it) no longer holds the disk actor: a job in another workspace is admitted, set
    up and run meanwhile. Before stop 60 it waited for the walk (0.6 s per job end in a
    workspace of 300,000 files; for good behind a walk that hangs), and health said `ok`."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    try:
        hold_the_guards_walk(serve, gate, reached)
        answers_elsewhere(serve)
        assert not gate.exists()  # it ran while the walk was held
    finally:
        gate.touch()
    assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
    assert serve.stop() == 0


def test_serve_answers_other_jobs_while_a_listing_walks(serve_factory, tmp_path):
    """`motor workspaces` walks the workspaces used since their last walk. That walk (held
    at `disk.walk`) no longer holds the disk actor either (stop 61): a job in another
    workspace runs meanwhile, a listing answers at once from the sizes known while another
    walk runs, and a listing whose own walk is held answers once it is done. Before, the
    listing walked in the actor's turn: the `motor run` waited for it (for good behind a
    walk that hangs) and health said `ok`."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    try:
        assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
        listing = serve.cli("workspaces", "--json")
        assert listing.returncode == 0 and b"walked" in listing.stdout, listing
        gate.unlink()
        reached.unlink(missing_ok=True)
        assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
        # held at the barrier, whichever comes first: this listing's walk of `walked` (then
        # the next listing answers at once), or the guard's (then both do)
        held = serve.cli_popen("workspaces", "--json")
        wait_for(reached.exists, timeout=30, what="a walk to reach the barrier")
        answers_elsewhere(serve)
        again = serve.cli("workspaces", "--json", timeout=20)  # not behind the walk
        assert again.returncode == 0 and b"walked" in again.stdout, again
        assert not gate.exists()  # all that while the walk was held
    finally:
        gate.touch()
    out, _ = held.communicate(timeout=30)
    assert held.returncode == 0 and b"walked" in out
    assert serve.stop() == 0


def test_serve_starts_while_its_first_maintenance_pass_walks(serve_factory, tmp_path):
    """After a restart the disk manager's size cache is empty, and its first maintenance
    pass walks every catalogued workspace. The runner starts and runs jobs meanwhile: the
    disk's part of the start-up pass runs right after the start, off the disk actor's
    turn (stop 61). Before, the start waited for that walk: no socket while a big tree (or
    a file system that stopped answering) was walked."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
    assert serve.stop() == 0
    gate.unlink()
    reached.unlink(missing_ok=True)
    start_and_run_while_held(serve, gate, reached, "the first pass's walk")
    assert serve.cli("run", "--workspace", "walked", "--", "true").returncode == 0
    assert serve.stop() == 0


def test_serve_keeps_a_workspace_a_job_was_admitted_to_while_its_gone_tree_was_walked(
        serve_factory, tmp_path):
    """The first maintenance pass after a restart surveys every catalogued workspace off the
    disk actor's turn and forgets those whose tree is gone. A job admitted to such a
    workspace while that walk runs (held at `disk.walk`) makes its tree again: when the
    walk lands the workspace stays catalogued (`Trees.keep_walk`), so `motor workspaces`
    lists it, and eviction and retention know it. Without that rule it was forgotten under
    the running job."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    assert serve.cli("run", "--workspace", "kept", "--", "true").returncode == 0
    tree = workspace_path(serve, "kept")
    assert serve.stop() == 0
    shutil.rmtree(tree)  # the tree is gone; its catalog entry stays
    gate.unlink()
    reached.unlink(missing_ok=True)
    done = tmp_path / "done"
    try:
        serve.start()
        wait_for(reached.exists, timeout=30, what="the first pass's walk to reach the barrier")
        with Client(serve.socket, timeout=30) as client:
            job = client.submit({"command": ["sh", "-c", f"until [ -e {done} ]; do sleep 0.05; done"],
                                 "workspace": "kept"})
            wait_for(lambda: client.get(job.job_id).state == "running", timeout=30,
                     what="the job in the gone workspace to run")
        assert not gate.exists()  # admitted and started while the walk was held
    finally:
        gate.touch()
    try:
        wait_for(lambda: b"tree of workspace kept" in serve.log.read_bytes(), timeout=30,
                 what="the walk to land")
        assert "kept" in names(serve)
    finally:
        done.touch()
    assert ended(serve, job.job_id) == "succeeded"
    assert "kept" in names(serve)
    assert serve.stop() == 0


def names(serve) -> list[str]:
    """The workspaces `motor workspaces` lists."""
    return [row["name"] for row in json.loads(serve.cli("workspaces", "--json").stdout)]


def workspace_path(serve, name: str) -> Path:
    """Where workspace `name`'s tree is, as `motor workspaces` lists it."""
    (row,) = [r for r in json.loads(serve.cli("workspaces", "--json").stdout)
              if r["name"] == name]
    return Path(row["path"])


def answers_elsewhere(serve, word: str = "meanwhile") -> None:
    """A `motor run` in another workspace answers (within 20 s)."""
    result = serve.cli("run", "--workspace", "other", "--", "echo", word, timeout=20)
    assert (result.returncode, result.stdout) == (0, word.encode() + b"\n"), result


def answers_while_held(serve, gate: Path, reached: Path, what: str,
                       word: str = "meanwhile") -> None:
    """Once `what` waits at the fault barrier `gate`, a `motor run` in another workspace
    answers, and the barrier is still closed."""
    wait_for(reached.exists, timeout=30, what=f"{what} to reach the barrier")
    answers_elsewhere(serve, word)
    assert not gate.exists()  # it answered while the barrier held


def trash_emptied(root: Path, pattern: str) -> None:
    """Until `root`'s trash holds nothing named like `pattern`."""
    trash = root / ".motor-trash"
    wait_for(lambda: not list(trash.glob(pattern)), timeout=30, what="the trash to be emptied")


def serve_with_passes_every_second(serve_factory, tmp_path, point: str, *, open: bool,
                                   config: str = ""):
    """A started `motor serve` with a maintenance pass every second (and `config`), the
    fault point `point` waiting for `gate` (there if `open`): (serve, gate, reached)."""
    gate, reached = tmp_path / "gate", tmp_path / "gate.reached"
    if open:
        gate.touch()
    path = tmp_path / "motor.toml"
    path.write_text("maintenance_interval_s = 1\n" + config)
    serve = serve_factory("--isolation", "none", "--config", str(path))
    serve.env = {"MOTOR_FAULTS": f"{point}=wait:{gate}"}
    return serve.start(), gate, reached


def test_serve_answers_other_jobs_while_an_expired_workspace_is_deleted(serve_factory, tmp_path):
    """A maintenance pass deletes a task workspace idle 24 h. Its tree is moved into the
    trash in the disk actor's turn, and deleted (as long as the tree is big) by the
    trash's collection in the next pass's walk, off that turn (stop 62): a `motor run` in
    another workspace answers while that deletion is held (the fault point `disk.purge`).
    Before, the whole tree was deleted in the actor's turn, and every admission and setup
    waited for it."""
    serve, gate, reached = serve_with_passes_every_second(serve_factory, tmp_path,
                                                          "disk.purge", open=True)
    assert serve.cli("run", "--workspace", "old", "--", "sh", "-c",
                     "mkdir -p src && echo x > src/a").returncode == 0
    assert serve.stop() == 0
    catalog = Catalog(serve.state_dir)
    entry = dataclasses.asdict(catalog.get("old"))
    catalog.close()
    entry["last_used_ms"] -= 25 * 3600 * 1000  # idle for 25 h: a change as the runner writes it
    with catalog.journal_path.open("a") as f:
        f.write(json.dumps({"put": entry}) + "\n")
    tree = Path(entry["path"])
    gate.unlink()
    try:
        serve.start()
        wait_for(lambda: not tree.exists(), timeout=30, what="the expired workspace to go")
        answers_elsewhere(serve)
        answers_while_held(serve, gate, reached, "the trash's collection", "still")
        assert "old" not in names(serve)
    finally:
        gate.touch()
    trash_emptied(tree.parent, "old.*")
    assert serve.stop() == 0


def test_serve_answers_other_jobs_while_a_workspaces_stale_units_are_swept(
        serve_factory, tmp_path):
    """The first maintenance pass after a start sweeps each idle workspace's stale Cargo
    units. Its scan of `target/` runs in the pass's walk, off the disk actor's turn, and
    what it found is moved into the trash in the turn, deleted by the next pass's walk
    (stop 63): a `motor run` in another workspace answers while that scan is held (the
    fault point `disk.sweep`). Before, the scan and the deletions ran in the actor's turn,
    and every admission and setup on the host waited for them (a target of 200,000 stale
    files: a `motor run` elsewhere took 1.6 s instead of 0.05)."""
    serve, gate, reached = serve_with_passes_every_second(serve_factory, tmp_path,
                                                          "disk.sweep", open=True)
    unit = "target/debug/deps/libdemo-0123456789abcdef.rlib"
    incremental = "target/debug/incremental/demo-0123456789abcdef"
    assert serve.cli("run", "--workspace", "crate", "--", "sh", "-c",
                     f"mkdir -p {incremental} target/debug/deps && echo x > {unit} && "
                     f"echo y > {incremental}/s"
                     ).returncode == 0
    tree = workspace_path(serve, "crate")
    assert serve.stop() == 0
    three_days_ago = time.time() - 3 * 86400  # stale: every output unread for 48 h
    for path in (tree / unit, tree / incremental / "s"):
        os.utime(path, (three_days_ago, path.stat().st_mtime))
    gate.unlink()
    try:
        serve.start()
        answers_while_held(serve, gate, reached, "the sweep's scan")
        assert (tree / unit).exists() and (tree / incremental).exists()  # not swept yet
    finally:
        gate.touch()
    wait_for(lambda: not (tree / unit).exists() and not (tree / incremental).exists(),
             timeout=30, what="the stale unit and incremental directory to be swept")
    assert (tree / "target" / "debug" / "deps").is_dir()  # only what was stale went
    trash_emptied(tree.parent, "demo-*")
    assert serve.stop() == 0


def test_serve_answers_other_jobs_while_the_guard_deletes_incremental_dirs(
        serve_factory, tmp_path):
    """A job leaves its workspace's `target/` over the build-folder cap: the guard drops
    the incremental directories by moving them into the trash, in the disk actor's turn,
    and the next pass's walk deletes them, off that turn (stop 63). A `motor run` in
    another workspace answers while that deletion is held (the fault point `disk.purge`).
    Before, the guard deleted them in the actor's turn, then walked the workspace there:
    every admission and setup on the host waited for both."""
    serve, gate, reached = serve_with_passes_every_second(
        serve_factory, tmp_path, "disk.purge", open=False,
        config="build_folder_cap_bytes = 65536\n")
    incremental = "target/debug/incremental/demo-0123456789abcdef"
    try:
        assert serve.cli("run", "--workspace", "big", "--", "sh", "-c",
                         f"mkdir -p {incremental} && head -c 300000 /dev/urandom > "
                         f"{incremental}/s").returncode == 0
        answers_while_held(serve, gate, reached, "the deletion")
        tree = workspace_path(serve, "big")
        assert not (tree / incremental).exists()  # dropped from the workspace
    finally:
        gate.touch()
    trash_emptied(tree.parent, "demo-*")
    assert serve.stop() == 0


def test_serve_answers_other_jobs_while_the_guard_walks_a_workspace_used_during_a_pass(
        serve_factory, tmp_path):
    """A job ends in a workspace while a maintenance pass's walk runs (held at
    `disk.walk`): its sizes are stale when the pass lands, so its build-folder guard needs
    another walk. That walk runs off the disk actor's turn, right after the pass (stop 63):
    a `motor run` in another workspace answers while it is held (`disk.guard`). Before, the
    pass walked it in the actor's turn, and every admission and setup waited for it."""
    walk, guard = tmp_path / "walk", tmp_path / "guard"
    walk.touch()
    guard.touch()
    serve = serve_factory("--isolation", "none")
    serve.env = {"MOTOR_FAULTS": f"disk.walk=wait:{walk},disk.guard=wait:{guard}"}
    serve.start()
    assert serve.cli("run", "--workspace", "used", "--", "true").returncode == 0
    assert serve.stop() == 0
    for gate in (walk, guard):
        gate.unlink()
        Path(f"{gate}.reached").unlink(missing_ok=True)
    try:
        serve.start()
        wait_for(Path(f"{walk}.reached").exists, timeout=30,
                 what="the first pass's walk to reach the barrier")
        assert serve.cli("run", "--workspace", "used", "--", "true").returncode == 0
        walk.touch()
        answers_while_held(serve, guard, Path(f"{guard}.reached"), "the guard's walk")
    finally:
        walk.touch()
        guard.touch()
    assert serve.stop() == 0


def test_serve_answers_health_while_expired_jobs_are_deleted(serve_factory, tmp_path):
    """A maintenance pass deletes the jobs whose day of retention has passed. The deletion
    is the disk's work (3.7 ms per MiB of stored output here: seconds for a day's verbose
    jobs), and since stop 63 it runs in a worker thread, in batches of at most
    EXPIRE_BATCH_BYTES: the event loop answers health while one is held (the fault point
    `store.expire`). Before, it ran on the event loop, and the runner answered nothing
    until it was done."""
    import sqlite3

    serve, gate, reached = serve_with_passes_every_second(  # nothing expires until told
        serve_factory, tmp_path, "store.expire", open=False)
    try:
        with Client(serve.socket, timeout=30) as client:
            job = client.submit({"command": ["echo", "old output"], "workspace": "w"})
        assert ended(serve, job.job_id) == "succeeded"
        db = sqlite3.connect(serve.state_dir / "motor.db", timeout=30)
        with db:  # its day is over (as the runner would have written it a day ago)
            db.execute("UPDATE jobs SET retain_until_ms=1 WHERE job_id=?", (job.job_id,))
        db.close()
        wait_for(reached.exists, timeout=30, what="the expiry to reach the barrier")
        with Client(serve.socket, timeout=10) as client:
            assert client.health()["status"] in ("ok", "degraded")
        assert not gate.exists()  # answered while the deletion was held
    finally:
        gate.touch()
    with Client(serve.socket, timeout=30) as client:
        wait_for(lambda: job.job_id not in [r.job_id for r in client.jobs(all=True)],
                 timeout=30, what="the expired job to go")
    assert serve.stop() == 0


def test_serve_stops_at_once_while_a_walk_is_held(serve_factory, tmp_path):
    """A walk of a workspace stuck on a file system that stopped answering (held at
    `disk.walk`) does not hold `motor serve`'s stop: the walk only reads, so the runner
    leaves it to its worker thread and exits 0 at once (`offload.abandonable`, stop 61).
    Before, SIGTERM was answered only once the walk returned (15 s and more in the probe:
    for good on a hung file system)."""
    serve, gate, reached = serve_with_gated_walks(serve_factory, tmp_path)
    try:
        hold_the_guards_walk(serve, gate, reached)
        assert serve.stop(timeout=10) == 0
        assert not gate.exists()  # it stopped while the walk was held
    finally:
        gate.touch()


def test_serve_starts_while_its_staging_sweep_is_held(serve_factory, tmp_path):
    """At its start the disk actor sweeps the bundle staging leftovers of a runner killed
    mid-unpack under every workspace root. That sweep (held at `disk.staging`, as a
    workspace root that stopped answering holds it) runs off the start since stop 61: the
    runner starts and runs a job meanwhile. Before, the disk actor's start waited for it,
    and the runner's with it (no socket)."""
    gate, reached = tmp_path / "gate", tmp_path / "gate.reached"
    serve = serve_factory("--isolation", "none")
    serve.env = {"MOTOR_FAULTS": f"disk.staging=wait:{gate}"}
    start_and_run_while_held(serve, gate, reached, "the staging sweep")
    assert serve.stop() == 0


def start_and_run_while_held(serve, gate, reached, what: str) -> None:
    """Start `serve` with its fault barrier closed: once `what` waits there, a job in
    another workspace runs; the barrier opens again whatever happens."""
    try:
        serve.start()
        answers_while_held(serve, gate, reached, what, "started")
    finally:
        gate.touch()

