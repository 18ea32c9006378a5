"""`motor serve`: options -> RunnerConfig -> `trio.run(motor.runner.serve_forever, config)`."""

from __future__ import annotations

import argparse

from motor.config import ConfigError, RunnerConfig, build_config, load_toml

#: (flag, RunnerConfig field, argparse keyword arguments)
SERVE_OPTIONS: list[tuple[str, str, dict]] = [
    ("--state-dir", "state_dir", {"metavar": "DIR", "help": "records, output, bundles, default workspace root"}),
    ("--socket", "socket", {"metavar": "PATH", "help": "Unix socket (default <state-dir>/motor.sock)"}),
    ("--socket-group", "socket_group", {"metavar": "GROUP", "help": "make the socket 0660 and owned by GROUP"}),
    ("--listen", "listen", {"metavar": "HOST:PORT", "help": "also serve HTTP on TCP (non-loopback needs --token-file)"}),
    ("--token-file", "token_file", {"metavar": "FILE", "help": "bearer token required on TCP requests; without it TCP serves only the read-only dashboard and /metrics"}),
    ("--body-timeout", "body_timeout_s", {"metavar": "SECONDS", "type": float, "help": "a request body must arrive within this (a bundle upload: never pause longer) (30)"}),
    ("--head-timeout", "head_timeout_s", {"metavar": "SECONDS", "type": float, "help": "a connection must send a request head within this; an idle kept-alive one is closed after it (5)"}),
    ("--max-connections", "max_connections", {"metavar": "N", "type": int, "help": "open HTTP connections; more are answered 503 (1024)"}),
    ("--max-weight", "max_weight", {"metavar": "N", "type": int, "help": "bound on running + setting-up claims (28)"}),
    ("--max-queue-depth", "max_queue_depth", {"metavar": "N", "type": int, "help": "bound on accepted, not yet running jobs (64)"}),
    ("--linux-cpus", "linux_cpus", {"metavar": "LIST", "help": "confine jobs to these CPUs, e.g. 12-15,28-31"}),
    ("--windows-cpus", "windows_cpus", {"metavar": "LIST", "help": "CPUs to avoid while --windows-slot-lock is held"}),
    ("--windows-slot-lock", "windows_slot_lock", {"metavar": "PATH", "help": "lock file held by the other user of --windows-cpus"}),
    ("--free-space-floor-bytes", "free_space_floor_bytes", {"metavar": "N", "help": "hard free-space floor; 0 disables"}),
    ("--free-space-eviction-bytes", "free_space_eviction_bytes", {"metavar": "N", "help": "soft reclaim goal (2 x floor)"}),
    ("--build-folder-cap-bytes", "build_folder_cap_bytes", {"metavar": "N", "help": "per-workspace Cargo target/ cap (64 GiB)"}),
    ("--workspace-root", "workspace_root", {"metavar": "DIR", "action": "append", "help": "add a workspace root; new workspaces go in the first (repeatable; <state-dir>/workspaces stays a root)"}),
    ("--caller-root", "caller_root", {"metavar": "CALLER=HOST", "action": "append", "help": "a caller's path prefix served from a host directory (repeatable)"}),
    ("--compile-cache", "compile_cache", {"metavar": "DIR", "help": "shared compile cache, evicted only as a whole and not during a cache fill"}),
    ("--sysfs-root", "sysfs_root", {"metavar": "DIR", "help": "where CPU topology is read (/sys)"}),
    ("--capacity-file", "capacity_file", {"metavar": "PATH", "help": "declared jobs_min_bytes (/etc/motor-host/capacity.json)"}),
    ("--isolation", "isolation", {"choices": ["auto", "systemd", "cgroup", "affinity", "none"], "help": "how jobs are pinned and capped (auto)"}),
    ("--cgroup-parent", "cgroup_parent", {"metavar": "NAME", "help": "the cgroup that holds job groups, playing motor-jobs.slice (motor-jobs)"}),
    ("--start-slots", "start_slots", {"metavar": "N", "type": int, "help": "systemd: slot slices, with their spares, made at the start for the first one-CPU jobs (one per CPU, at most --max-weight and 8; 0: none)"}),
    ("--memory-per-vcpu-bytes", "memory_per_vcpu_bytes", {"metavar": "N", "help": "a claim's default memory_max (4 GiB)"}),
    ("--max-output-bytes-per-job", "max_output_bytes_per_job", {"metavar": "N", "help": "output kept per job before its oldest pages are evicted (256 MiB)"}),
    ("--log-level", "log_level", {"choices": ["debug", "info", "warning", "error"], "help": "what is written to standard error (info: also each job's end and the disk manager's deletions)"}),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the runner", description="Start the runner and serve its API.")
    p.add_argument("--config", metavar="FILE", help="TOML file with any of these options (flags win)")
    for flag, field, kwargs in SERVE_OPTIONS:
        p.add_argument(flag, dest=field, default=None, **kwargs)
    p.set_defaults(handler=cmd_serve)


def config_from_args(args: argparse.Namespace) -> RunnerConfig:
    """Defaults < --config file < flags; raises ConfigError."""
    file_values = load_toml(args.config) if getattr(args, "config", None) else {}
    flags = {field: getattr(args, field, None) for _, field, _ in SERVE_OPTIONS}
    return build_config(file_values, flags)


def _find(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `kinds` inside `exc`: through exception groups and the
    `__cause__` chain (a supervisor wraps a child's start-up failure in an escalation)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kinds):
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.append(current.__cause__)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        _preflight_token(config)
    except ConfigError as exc:
        return _error_line(exc, 2)
    if (taken := _preflight_listen(config)) is not None:
        return _error_line(taken, 1)
    # one line per record, as the warnings were before any configuration (the journal
    # stamps each line; docs/operations.md, "Watching it"), written by a thread: a standard
    # error that nobody reads never holds the runner (motor/logsink.py)
    from motor import logsink

    logsink.install(config.log_level)
    try:
        return _serve(config)
    finally:
        logsink.uninstall(logsink.DRAIN_S)


def _serve(config) -> int:
    """`trio.run` of the runner, its start-up failures sorted into one line and a status."""
    import sqlite3

    import trio

    from actors import SupervisorEscalation
    from motor import runner as runner_module
    from motor.api.server import SocketInUse
    from motor.execution.spawner import SpawnerError
    from motor.store.db import StoreError
    from motor.store.fileguard import DatabaseLost

    try:
        status = trio.run(runner_module.serve_forever, config)
    except BaseException as exc:  # noqa: BLE001 - sort start-up failures into one line
        if (found := _find(exc, (SocketInUse,))) is not None:
            return _error_line(found, 1)
        if (found := _find(exc, (ConfigError,))) is not None:
            return _error_line(found, 2)
        if (found := _find(exc, (DatabaseLost,))) is not None:  # its records saved
            return _error_line(found, EXIT_DATABASE_LOST)
        if (found := _find(exc, (StoreError, sqlite3.DatabaseError))) is not None:
            return _error_line(f"job database {config.state_path / 'motor.db'}: {found}", 2)
        if (found := _find(exc, (SpawnerError,))) is not None:  # keeperd: the jobs' keeper
            return _error_line(f"the jobs' keeper: {found}", EXIT_NO_KEEPER)
        if (found := _find(exc, (SupervisorEscalation,))) is not None:
            return _error_line(_gave_up(found), EXIT_GAVE_UP)
        if _find(exc, (KeyboardInterrupt,)) is not None:
            return 130
        return _crashed(exc)
    return status


#: `motor serve` exit status when the runner failed where no supervisor restarts it (an
#: error nothing expected), as Python's own for an uncaught exception
EXIT_CRASHED = 1


def _crashed(exc: BaseException) -> int:
    """The traceback of a failure no supervisor caught, logged through the sink like every
    other line, and EXIT_CRASHED. Before stop 68 it was left to Python's own handler, which
    writes it to standard error after the sink is gone and waits there for good when nobody
    reads (a runner that no longer serves but never exits, so never restarted)."""
    import traceback

    from motor import logsink

    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    logsink.line("motor: error: the runner failed where nothing restarts it; it stops so that "
                 f"the service manager starts it afresh (running jobs keep running):\n{text}")
    return EXIT_CRASHED


#: `motor serve` exit status when a subsystem's supervisor gave up (a crash loop): the
#: service manager (systemd `Restart=on-failure`) starts a fresh runner
EXIT_GAVE_UP = 3
#: ... when keeperd, which keeps the jobs, could not be started or reached at start-up (before
#: stop 49 a traceback, status 1): a lock or socket of it that cannot be used, or no answer
EXIT_NO_KEEPER = 4
#: ... when the job database's path no longer named the file it had open (removed, or
#: another file put there) and the runner stopped, its records saved (store/fileguard.py):
#: the service manager starts it again, on them
EXIT_DATABASE_LOST = 5


def _gave_up(escalation) -> str:
    """One line for a crash loop: the innermost supervisor that gave up, and the last
    failure of its child."""
    from actors import SupervisorEscalation

    while isinstance(escalation.last_exception, SupervisorEscalation):
        escalation = escalation.last_exception
    return (f"subsystem {escalation.name} gave up: it crashed more often than its restart budget"
            f" allows (last failure: {escalation.last_exception!r}); the runner stops so that the"
            f" service manager starts it afresh (running jobs keep running)")


def _preflight_token(config) -> None:
    """The token file read before anything starts (ConfigError: one line, exit 2). Before
    stop 57 an empty or unreadable one was found by the API actor, which crashed at each of
    its restarts (a traceback each) before the runner gave up."""
    if config.token_file:
        from motor.api.app import read_token_file
        read_token_file(config.token_file)


def _preflight_listen(config) -> str | None:
    """Why `--listen` cannot be bound (an address in use, not this host's), or None: a bind
    tried before anything starts (the API binds it again; one that loses a race still ends
    as a crash loop, exit 3). Before stop 57 an address in use was that crash loop."""
    if not config.listen:
        return None
    import socket
    host, _, port = config.listen.rpartition(":")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as exc:
        return f"cannot listen on {config.listen}: {exc.strerror or exc}"
    return None


def _error_line(exc: BaseException | str, status: int) -> int:
    from motor import logsink

    message = " ".join(str(exc).split())
    logsink.line(f"motor: error: {message}")  # the sink's, once `cmd_serve` installed it
    return status
