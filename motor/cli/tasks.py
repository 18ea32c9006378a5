"""`motor task ...` (the task client) and the hidden `motor worker runner ...` entry point."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

import msgspec

from motor.cli.outcome import EXIT_CANCELLED, EXIT_UNAVAILABLE
from motor.cli.text import printable

EXIT_BAD_INPUT = 2
EXIT_REFUSED = 75
EXIT_TIMEOUT = 124


def register(sub: argparse._SubParsersAction) -> None:
    from motor.cli import Parser

    p = sub.add_parser("task", help="the task client: turns over a fleet of runners (docs/tasks.md)")
    p.add_argument("--client-dir", metavar="DIR",
                   help="client state (default $MOTOR_CLIENT_DIR, else ~/.local/state/motor-client)")
    tsub = p.add_subparsers(dest="task_command", metavar="SUBCOMMAND", required=True, parser_class=Parser)

    s = tsub.add_parser("submit", help="create a task and its first turn; prints the task id",
                        usage="motor task submit --project PATH [--pin WORKER] [--run RUN] [--attached] -- CMD...")
    s.add_argument("--project", required=True, metavar="PATH", help="the project worktree to bundle")
    s.add_argument("--pin", metavar="WORKER", help="run every turn of this task on this worker")
    s.add_argument("--run", metavar="RUN", help="run membership (max_parallel from [runs.RUN] in workers.toml)")
    s.add_argument("--attached", action="store_true", help="run the turn in this process, output here")
    s.add_argument("--capability", metavar="CAP", action="append", default=[],
                   help="run only on workers listing CAP in workers.toml (repeatable)")
    s.add_argument("--json", action="store_true")
    s.add_argument("cmd", nargs="*", help=argparse.SUPPRESS)
    s.set_defaults(handler=_readable(cmd_submit), takes_command=True)

    s = tsub.add_parser("turn", help="queue the next turn of a task", usage="motor task turn TASK -- CMD...")
    s.add_argument("task")
    s.add_argument("--json", action="store_true")
    s.add_argument("cmd", nargs="*", help=argparse.SUPPRESS)
    s.set_defaults(handler=_readable(cmd_turn), takes_command=True)

    for name, fn, helptext in (("list", cmd_list, "tasks"), ("queue", cmd_queue, "the queue rows")):
        s = tsub.add_parser(name, help=helptext)
        s.add_argument("--json", action="store_true")
        s.set_defaults(handler=_readable(fn))
    s = tsub.add_parser("show", help="one task")
    s.add_argument("task")
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=_readable(cmd_show))
    s = tsub.add_parser("wait", help="wait for the task's current turn; exit with its status")
    s.add_argument("task")
    s.set_defaults(handler=_readable(cmd_wait))
    s = tsub.add_parser("cancel", help="cancel the task's queued and running turns")
    s.add_argument("task")
    s.set_defaults(handler=_readable(cmd_cancel))
    s = tsub.add_parser("reconcile", help="replace dead runners; start parked turns when slots are free")
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=_readable(cmd_reconcile))

    w = sub.add_parser("worker", help="hidden")
    sub._choices_actions = [a for a in sub._choices_actions if a.dest != "worker"]  # hidden command
    wsub = w.add_subparsers(dest="worker_command", metavar="SUBCOMMAND", required=True, parser_class=Parser)
    r = wsub.add_parser("runner", help="the detached turn runner (started by the task client)")
    r.add_argument("task")
    r.add_argument("turn")
    r.add_argument("--slot-token", required=True, metavar="UUID")
    r.add_argument("--client-dir", metavar="DIR")
    r.set_defaults(handler=_readable(cmd_worker_runner))


# --- helpers ----------------------------------------------------------------------------


class BadInput(Exception):
    def __init__(self, line: str, status: int = EXIT_BAD_INPUT):
        super().__init__(line)
        self.status = status


def _err(line: str) -> None:
    """One line on stderr, control characters escaped (a worker's detail may quote a
    command; motor/cli/text.py)."""
    sys.stderr.write(printable(line.rstrip("\n")) + "\n")
    sys.stderr.flush()


def _client_dir(args):
    from motor.tasks.store import ClientDir, default_client_dir

    root = args.client_dir or os.environ.get("MOTOR_CLIENT_DIR") or default_client_dir()
    return ClientDir(root)


def _fleet(cdir):
    from motor.tasks.workers import FleetError, load_fleet

    try:
        return load_fleet(cdir.root / "workers.toml")
    except FleetError as exc:
        raise BadInput(f"motor: error: {exc}") from None


def _command(args) -> list[str]:
    from motor.cli import UsageError, require_text

    command = list(args.cmd) + list(args.tail or [])
    if not command:
        raise UsageError(f"task {args.task_command} needs a command after --")
    require_text(("the command's word", word) for word in command)
    return command


def _run(args, body) -> int:
    """Open the queue actor in a trio nursery and run `body(cdir, fleet, queue, nursery)`."""
    import trio  # only the task commands need it (the client commands stay lean)

    from motor.tasks.queue import open_queue

    try:
        cdir = _client_dir(args)
        fleet = _fleet(cdir)

        async def main():
            async with trio.open_nursery() as n:
                queue = await open_queue(n, cdir)
                try:
                    return await body(cdir, fleet, queue, n)
                finally:
                    n.cancel_scope.cancel()

        return int(trio.run(main) or 0)
    except BadInput as exc:
        _err(str(exc))
        return exc.status
    except BaseExceptionGroup as eg:
        if (exc := _leaf(eg, BadInput)) is None:
            raise
        _err(str(exc))
        return exc.status


def _leaf(eg: BaseExceptionGroup, types):
    """The first exception of `types` in `eg` (nested groups looked into), or None."""
    group = eg.subgroup(types)
    if group is None:
        return None
    exc = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _readable(handler):
    """`handler`, with a client-dir file that cannot be read (store.ClientDirError, also from
    inside the queue actor's nursery) answered by one line on stderr and exit status 2, not
    a traceback (before stop 48 a damaged queue.json made every task command end in one)."""

    def guarded(args) -> int:
        from motor.tasks.store import ClientDirError  # when it runs: `--help` stays lean

        try:
            return handler(args)
        except ClientDirError as exc:
            _err(f"motor: error: {exc}")
            return EXIT_BAD_INPUT
        except BaseExceptionGroup as eg:
            if (exc := _leaf(eg, ClientDirError)) is None:
                raise
            _err(f"motor: error: {exc}")
            return EXIT_BAD_INPUT

    return guarded


def _task_client(cdir, fleet, queue, **kw):
    from motor.tasks.client import TaskClient

    return TaskClient(cdir, queue, fleet, **kw)


def turn_exit_status(turn) -> int | None:
    """The exit status of a finished turn (as `motor run` would give), None while it runs."""
    if turn is None or turn.state not in ("succeeded", "failed", "cancelled", "timed_out", "refused", "lost"):
        return None
    if turn.state == "cancelled":
        return EXIT_CANCELLED
    if turn.state == "timed_out":
        return EXIT_TIMEOUT
    if turn.state == "refused":
        return EXIT_REFUSED
    if turn.signal:
        return 128 + turn.signal
    if turn.exit_code is not None:
        return turn.exit_code
    return 1


def _print_json(data) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(data), indent=2).decode() + "\n")
    sys.stdout.flush()


# --- commands ---------------------------------------------------------------------------


def cmd_submit(args) -> int:
    command = _command(args)
    project = Path(args.project).expanduser()
    if not project.is_dir():
        from motor.cli import UsageError

        raise UsageError(f"--project {args.project}: not a directory")
    project = project.resolve()

    async def body(cdir, fleet, queue, nursery):
        from motor.tasks import core
        from motor.tasks.detached import retire, run_turn
        from motor.tasks.remote import probe_health

        if args.pin and fleet.get(args.pin) is None:
            raise BadInput(f"motor: error: unknown worker {args.pin!r} (workers.toml lists: "
                           f"{', '.join(fleet.names)})")
        capable = fleet.capable(args.capability)
        if args.pin and args.capability and fleet.get(args.pin) not in capable:
            raise BadInput(f"motor: error: worker {args.pin!r} lacks capability "
                           f"{', '.join(sorted(set(args.capability) - set(fleet.get(args.pin).capabilities)))}")
        if not capable:
            raise BadInput(f"motor: error: no worker in workers.toml lists capability "
                           f"{', '.join(sorted(set(args.capability)))}")
        tc = _task_client(cdir, fleet, queue)
        if args.attached:
            task_id, turn_id = await tc.create_task(str(project), command, pin=args.pin, run=args.run, attached=True,
                                                    capabilities=args.capability)
            _err(f"motor: task {task_id}")

            def reserve(L):
                return core.reserve_runner_slot(L.queue, L.runners, L.observe, task_id=task_id, turn_id=turn_id,
                                                reserver=tc.me, cap=core.UNCAPPED, new_token=tc.new_token)

            r = await queue.locked(reserve)
            # uncapped, and the row was made by this process in the lock hold before: no
            # reservation, live runner or foreign holder can exist for it yet
            assert r.acquired, f"attached turn {task_id}/{turn_id} not reserved: {r.kind}"
            await tc.complete_runner_spawn(task_id, turn_id, r.token, tc.me, mode="attached")
            turn = await run_turn(tc, task_id, turn_id, echo=True)
            await retire(tc, task_id)
            status = turn_exit_status(turn)
            return EXIT_UNAVAILABLE if status is None else status
        # detached: probe the worker(s) the turn may use; the turn is queued either way
        specs = [fleet.get(args.pin)] if args.pin else capable
        reports = []
        for spec in specs:  # one answering worker is enough to go on
            reports.append(await probe_health(spec, timeout=15.0))
            if isinstance(reports[-1], dict):
                break
        reachable = isinstance(reports[-1], dict)
        task_id, turn_id = await tc.create_task(str(project), command, pin=args.pin, run=args.run,
                                                capabilities=args.capability)
        if not reachable:
            def park(L):
                core.park(L.queue, task_id=task_id, turn_id=turn_id)
            await queue.locked(park)
            print(task_id, flush=True)
            for spec, rep in zip(specs, reports):
                _err(f"motor: worker {spec.name} unreachable at {spec.endpoint}: {rep}; "
                     f"task {task_id} stays queued")
            return EXIT_UNAVAILABLE
        result = await tc.start_turn(task_id, turn_id)
        await tc.reconcile()
        if args.json:
            _print_json({"task_id": task_id, "turn_id": turn_id, "start": result.outcome})
        else:
            print(task_id, flush=True)
        if result.outcome == "failed":
            _err(f"motor: task {task_id}: {result.detail}")
        return 0

    return _run(args, body)


def cmd_turn(args) -> int:
    command = _command(args)

    async def body(cdir, fleet, queue, nursery):
        from motor.tasks import core

        tc = _task_client(cdir, fleet, queue)
        try:
            turn_id = await tc.add_turn(args.task, command)
        except core.QueueError as exc:
            if exc.code == "TASK_UNKNOWN":
                raise BadInput(f"motor: error: unknown task {args.task}") from None
            raise BadInput(f"motor: error: {exc.detail}") from None
        result = await tc.start_turn(args.task, turn_id)
        await tc.reconcile()
        if args.json:
            _print_json({"task_id": args.task, "turn_id": turn_id, "start": result.outcome})
        else:
            print(turn_id, flush=True)
        return 0

    return _run(args, body)


def _task_view(cdir, task, queue, runners) -> dict:
    from motor.tasks.store import observe_process

    data = msgspec.to_builtins(task)
    data["state"] = task.state
    rec = runners.get(task.task_id)
    if rec is not None:
        data["runner"] = dict(msgspec.to_builtins(rec), live=observe_process(rec.identity) in ("matching", "ambiguous"))
    data["queue"] = [msgspec.to_builtins(e) for e in queue.entries if e.task_id == task.task_id]
    return data


def cmd_list(args) -> int:
    cdir = _client_dir(args)
    tasks = cdir.list_tasks()
    if args.json:
        _print_json([dict(msgspec.to_builtins(t), state=t.state) for t in tasks])
        return 0
    for t in tasks:
        cur = t.current
        print(f"{t.task_id}  {t.state:<11} turns={len(t.turns)}  worker={(cur.worker if cur else None) or '-'}  "
              f"{' '.join(cur.command) if cur else ''}")
    return 0


def cmd_show(args) -> int:
    cdir = _client_dir(args)
    task = cdir.read_task(args.task)
    if task is None:
        _err(f"motor: error: unknown task {args.task}")
        return EXIT_BAD_INPUT
    view = _task_view(cdir, task, cdir.read_queue(), cdir.read_runners())
    if args.json:
        _print_json(view)
        return 0
    print(f"task {task.task_id}  {task.state}  project {task.project}  workspace {task.workspace}"
          + (f"  pin {task.pin}" if task.pin else "") + (f"  run {task.run}" if task.run else ""))
    if "runner" in view:
        r = view["runner"]
        print(f"runner pid {r['identity']['pid']} ({'live' if r['live'] else 'gone'}) turn {r['turn_id']}")
    for turn in task.turns:
        print(f"  turn {turn.turn_id}: {turn.state:<11} worker={turn.worker or '-'} job={turn.job_id or '-'} "
              f"exit={turn.exit_code if turn.exit_code is not None else '-'}  {' '.join(turn.command)}"
              + (f"  ({turn.detail})" if turn.detail else "")
              + (f"  [ran on the runner process donated by task {turn.donated_from}]"
                 if turn.donated_from else ""))
    return 0


def cmd_queue(args) -> int:
    cdir = _client_dir(args)
    queue = cdir.read_queue()
    if args.json:
        _print_json([msgspec.to_builtins(e) for e in queue.entries])
        return 0
    for e in sorted(queue.entries, key=lambda e: e.queue_id):
        holder = e.dispatch_owner or e.owner
        print(f"{e.queue_id:>5} {e.task_id} turn {e.turn_id} {e.state:<11} worker={e.worker or '-'} "
              f"holder={holder.pid if holder else '-'}"
              + (f" reserved={e.slot_reservation.token}" if e.slot_reservation else ""))
    return 0


def cmd_wait(args) -> int:
    import trio  # only the task commands need it (the client commands stay lean)

    cdir = _client_dir(args)
    task = cdir.read_task(args.task)
    if task is None:
        _err(f"motor: error: unknown task {args.task}")
        return EXIT_BAD_INPUT
    turn_id = task.current.turn_id

    async def main():
        while True:
            t = cdir.read_task(args.task)
            turn = next((x for x in t.turns if x.turn_id == turn_id), None)
            status = turn_exit_status(turn)
            if status is not None:
                return status
            await trio.sleep(0.05)

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        return EXIT_CANCELLED


def cmd_cancel(args) -> int:
    async def body(cdir, fleet, queue, nursery):
        from motor.tasks import core

        tc = _task_client(cdir, fleet, queue)
        try:
            await tc.cancel(args.task)
        except core.QueueError as exc:
            raise BadInput(f"motor: error: unknown task {args.task}" if exc.code == "TASK_UNKNOWN"
                           else f"motor: error: {exc}") from None
        print("cancelled", flush=True)
        return 0

    return _run(args, body)


def cmd_reconcile(args) -> int:
    async def body(cdir, fleet, queue, nursery):
        tc = _task_client(cdir, fleet, queue)
        results = await tc.reconcile()
        summary = {"started": sum(r.outcome == "spawned" for r in results),
                   "failed": [r.detail for r in results if r.outcome == "failed"]}
        if args.json:
            _print_json(summary)
        else:
            print(f"started {summary['started']} runner(s)")
            for d in summary["failed"]:
                _err(f"motor: {d}")
        return 0

    return _run(args, body)


def cmd_worker_runner(args) -> int:
    try:
        token = uuid.UUID(args.slot_token)
    except ValueError:
        from motor.cli import UsageError

        raise UsageError(f"--slot-token {args.slot_token!r} is not a UUID") from None

    async def body(cdir, fleet, queue, nursery):
        from motor.tasks.detached import detached_runner

        tc = _task_client(cdir, fleet, queue)
        return await detached_runner(tc, args.task, args.turn, token)

    return _run(args, body)


__all__ = ["register", "turn_exit_status"]
